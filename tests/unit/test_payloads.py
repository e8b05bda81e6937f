"""Typed payloads without Redis: which annotations make a job typed, how they resolve, the
checks at declaration, what an enqueue path enqueues, what a handler receives, the errors."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional, TypedDict

import pytest
from pydantic import BaseModel, ConfigDict, Field, computed_field, field_validator, model_validator

from kumiko_dramatiq import (
    Cron,
    Event,
    Feature,
    JobConfigError,
    JobContext,
    JobMeta,
    PayloadError,
    Registry,
)
from kumiko_dramatiq.payloads import (
    STALE_NOTE,
    PayloadField,
    is_plain_model,
    load_payload,
    payload_to_enqueue,
    schema_fields,
    schema_type,
)
from kumiko_dramatiq.testing import run_job

if TYPE_CHECKING:
    from kumiko_dramatiq import JobContext as ContextForTypeCheckers

    class OnlyForTypeCheckers(TypedDict):
        invoice: str


MAX_BYTES = 1_048_576


class Line(BaseModel):
    sku: str
    quantity: int


class Invoice(BaseModel):
    invoice: str
    amount: int
    lines: list[Line] = []


class Defaults(BaseModel):
    currency: str = "EUR"
    at: datetime = datetime(2024, 1, 1, tzinfo=UTC)


class Other(BaseModel):
    invoice: str
    amount: int


class Plain(TypedDict):
    invoice: str


def typed_handler(payload: Invoice, ctx: JobContext) -> Invoice:
    return payload


def job_of(handler: Callable[..., Any], **options: Any) -> Any:
    feature = Feature("t")
    feature.job("job", **options)(handler)
    return Registry([feature]).jobs["t:job:job"]


# -- which annotations make a job typed -------------------------------------------------------
def test_a_bare_model_annotation_makes_the_job_typed() -> None:
    assert job_of(typed_handler).payload_model is Invoice


def test_a_string_annotation_resolves_in_the_handlers_module() -> None:
    # this module says `from __future__ import annotations`: every annotation is a string
    assert typed_handler.__annotations__["payload"] == "Invoice"
    assert job_of(typed_handler).payload_model is Invoice


@pytest.mark.parametrize(
    "annotation",
    [
        Optional[Invoice],  # noqa: UP045 (the spelling under test)
        Invoice | None,
        Annotated[Invoice, "meta"],
        Plain,
        dict,
        dict[str, Any],
    ],
    ids=["Optional", "union-with-None", "Annotated", "TypedDict", "dict", "dict[str, Any]"],
)
def test_anything_but_a_bare_model_leaves_the_job_untyped(annotation: Any) -> None:
    def handler(payload: Any, ctx: JobContext) -> Any:
        return payload

    handler.__annotations__["payload"] = annotation  # a class object, not a string
    job = job_of(handler)
    assert job.payload_model is None
    assert job.payload_hint_problem is None
    assert run_job(Registry([_feature_of(handler)]), "u:job:job", {"invoice": "x"}) == {
        "invoice": "x"
    }


@pytest.mark.parametrize(
    "annotation",
    ["Optional[Invoice]", "Invoice | None", "Annotated[Invoice, 'meta']", "Plain", "dict"],
)
def test_the_same_spelled_as_strings_leave_the_job_untyped(annotation: str) -> None:
    def handler(payload: Any, ctx: JobContext) -> Any:
        return payload

    handler.__annotations__["payload"] = annotation
    job = job_of(handler)
    assert job.payload_model is None
    assert job.payload_hint_problem is None


def _feature_of(handler: Callable[..., Any]) -> Feature:
    feature = Feature("u")
    feature.job("job")(handler)
    return feature


def test_base_model_itself_and_no_annotation_leave_the_job_untyped() -> None:
    def bare(payload, ctx):  # type: ignore[no-untyped-def]
        return payload

    def base(payload: BaseModel, ctx: JobContext) -> Any:
        return payload

    assert job_of(bare).payload_model is None
    assert job_of(base).payload_model is None


def test_a_class_object_annotation_makes_the_job_typed_too() -> None:
    def handler(payload: Any, ctx: JobContext) -> Any:
        return payload

    handler.__annotations__["payload"] = Invoice
    assert job_of(handler).payload_model is Invoice


def early_handler(payload: DefinedBelow, ctx: JobContext) -> DefinedBelow:
    return payload


early = Feature("early")
early.job("job")(early_handler)  # `DefinedBelow` does not exist yet


class DefinedBelow(BaseModel):
    x: int = 1


def test_a_model_defined_below_its_handler_resolves_when_the_registry_is_built() -> None:
    registry = Registry([early])
    assert registry.jobs["early:job:job"].payload_model is DefinedBelow
    assert run_job(registry, "early:job:job") == DefinedBelow(x=1)


def test_an_annotation_that_never_resolves_leaves_the_job_untyped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def handler(payload: OnlyForTypeCheckers, ctx: JobContext) -> Any:
        return payload

    feature = Feature("ghost")
    feature.job("job")(handler)
    with caplog.at_level(logging.WARNING, logger="kumiko_dramatiq"):
        registry = Registry([feature])
    job = registry.jobs["ghost:job:job"]
    assert job.payload_model is None
    assert job.payload_hint_problem is not None
    assert "OnlyForTypeCheckers" in job.payload_hint_problem
    (line,) = caplog.messages
    assert line.startswith("ghost:job:job: the payload annotation does not resolve (")
    assert "NameError" in line
    assert run_job(registry, "ghost:job:job", {"invoice": "x"}) == {"invoice": "x"}


def test_a_string_that_is_not_a_class_name_is_not_evaluated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def handler(payload: dict[str, OnlyForTypeCheckers], ctx: JobContext) -> Any:
        return payload

    with caplog.at_level(logging.WARNING, logger="kumiko_dramatiq"):
        job = job_of(handler)
    assert (job.payload_model, job.payload_hint_problem, caplog.messages) == (None, None, [])


def test_a_quoted_forward_reference_resolves() -> None:
    def handler(payload: Any, ctx: JobContext) -> Any:
        return payload

    handler.__annotations__["payload"] = "'Invoice'"
    assert job_of(handler).payload_model is Invoice


def test_only_the_payload_annotation_is_evaluated() -> None:
    def handler(payload: Invoice, ctx: ContextForTypeCheckers) -> Invoice:
        return payload

    assert job_of(handler).payload_model is Invoice


def test_a_model_local_to_the_declaring_function_resolves() -> None:
    class Local(BaseModel):
        n: int = 0

    def handler(payload: Local, ctx: JobContext) -> Local:
        return payload

    feature = Feature("local")
    feature.job("job")(handler)  # declared here: this function's names are in scope
    registry = Registry([feature])
    assert registry.jobs["local:job:job"].payload_model is Local
    assert run_job(registry, "local:job:job", {"n": 2}) == Local(n=2)


def test_a_model_held_by_the_handlers_closure_resolves() -> None:
    class Local(BaseModel):
        n: int

    def handler(payload: Local, ctx: JobContext) -> Any:
        return Local.model_validate(payload)  # the body names it: the closure holds it

    assert job_of(handler).payload_model is Local


def test_a_closure_name_not_bound_yet_does_not_matter() -> None:
    def handler(payload: Invoice, ctx: JobContext) -> Any:
        return later(payload)  # `later` is bound below: its cell is empty at declaration

    feature = Feature("cells")
    feature.job("job")(handler)
    feature.job("untyped")(lambda payload, ctx: later(payload))

    def later(payload: Any) -> Any:
        return payload

    registry = Registry([feature])
    assert registry.jobs["cells:job:job"].payload_model is Invoice
    assert registry.jobs["cells:job:untyped"].payload_model is None


def test_a_wrapped_handler_and_a_callable_object_are_read_through() -> None:
    def logged(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any) -> Any:
            return fn(*args)

        return wrapper

    class Handler:
        def __call__(self, payload: Invoice, ctx: JobContext) -> Invoice:
            return payload

    assert job_of(logged(typed_handler)).payload_model is Invoice
    assert job_of(Handler()).payload_model is Invoice


# -- declaration: jobs that run with {} ---------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "what"),
    [
        ({"trigger": Cron("0 3 * * *")}, "a cron job"),
        ({"trigger": Cron("0 3 * * *"), "per_tenant": True}, "a cron job"),
        ({"run_on_boot": True}, "a run_on_boot job"),
        ({"boot_gate": True}, "a boot gate"),
    ],
)
def test_a_job_that_runs_with_an_empty_payload_needs_a_model_that_accepts_it(
    options: dict[str, Any], what: str
) -> None:
    feature = Feature("c")
    with pytest.raises(JobConfigError) as caught:
        feature.job("job", **options)(typed_handler)
    assert str(caught.value) == (
        "c:job:job: payload model Invoice must accept the empty payload {}: "
        f"{what} runs with it (payload.invoice is invalid for Invoice: Field required; "
        "and 1 more error)"
    )

    def with_defaults(payload: Defaults, ctx: JobContext) -> Defaults:
        return payload

    feature.job("fine", **options)(with_defaults)


def test_jobs_started_by_hand_or_by_an_event_may_require_fields() -> None:
    feature = Feature("c")
    feature.job("manual")(typed_handler)
    feature.job("event", trigger=Event("invoice.paid"))(typed_handler)
    assert len(Registry([feature]).jobs) == 2


def late_cron(payload: RequiresAField, ctx: JobContext) -> None:
    pass


late = Feature("late")
late.job("cron", trigger=Cron("0 3 * * *"))(late_cron)


class RequiresAField(BaseModel):
    needed: str


def test_a_forward_referenced_cron_model_is_checked_when_the_registry_is_built() -> None:
    with pytest.raises(JobConfigError, match=r"late:job:cron: payload model RequiresAField"):
        Registry([late])


# -- what is enqueued, what the handler receives ------------------------------------------------
def test_a_dict_is_validated_and_enqueued_as_the_models_json_dump() -> None:
    job = job_of(typed_handler)
    body = payload_to_enqueue(job, {"invoice": "INV-7", "amount": "12"}, max_bytes=MAX_BYTES)
    assert body == {"invoice": "INV-7", "amount": 12, "lines": []}


class Stamped(BaseModel):
    at: datetime
    price: Decimal


def test_an_instance_is_enqueued_as_its_json_dump() -> None:
    def handler(payload: Stamped, ctx: JobContext) -> Stamped:
        return payload

    job = job_of(handler)
    given = Stamped(at=datetime(2024, 5, 1, 12, tzinfo=UTC), price=Decimal("9.90"))
    assert payload_to_enqueue(job, given, max_bytes=MAX_BYTES) == {
        "at": "2024-05-01T12:00:00Z",
        "price": "9.90",
    }


def test_run_job_hands_the_handler_a_model_from_a_dict_or_an_instance() -> None:
    registry = Registry([_typed("invoices", typed_handler)])
    from_dict = run_job(registry, "invoices:job:job", {"invoice": "INV-7", "amount": 3})
    from_instance = run_job(registry, "invoices:job:job", Invoice(invoice="INV-7", amount=3))
    assert isinstance(from_dict, Invoice)
    assert from_dict == from_instance == Invoice(invoice="INV-7", amount=3)


def test_run_job_hands_an_async_handler_a_model() -> None:
    async def handler(payload: Invoice, ctx: JobContext) -> Invoice:
        return payload

    registry = Registry([_typed("invoices", handler)])
    received = run_job(registry, "invoices:job:job", {"invoice": "INV-7", "amount": 3})
    assert received == Invoice(invoice="INV-7", amount=3)


def test_run_job_refuses_what_dispatch_refuses() -> None:
    registry = Registry([_typed("invoices", typed_handler)])
    with pytest.raises(PayloadError, match=r"invoices:job:job: payload\.amount is invalid"):
        run_job(registry, "invoices:job:job", {"invoice": "INV-7", "amount": "lots"})


def _typed(name: str, handler: Callable[..., Any]) -> Feature:
    feature = Feature(name)
    feature.job("job")(handler)
    return feature


def test_an_untyped_job_still_refuses_a_model_instance() -> None:
    registry = Registry([_feature_of(lambda payload, ctx: payload)])
    with pytest.raises(PayloadError, match=r"u:job:job: payload must be a JSON object \(dict\)"):
        run_job(registry, "u:job:job", Invoice(invoice="x", amount=1))


# -- errors: one line, the job, the field path, the bad value, never the whole payload ----------
def refusal(
    payload: Any, handler: Callable[..., Any] = typed_handler, path: str = "payload"
) -> str:
    with pytest.raises(PayloadError) as caught:
        payload_to_enqueue(job_of(handler), payload, max_bytes=MAX_BYTES, path=path)
    text = str(caught.value)
    assert "\n" not in text
    return text


def test_a_bad_field_is_named_with_its_path_and_value() -> None:
    assert refusal({"invoice": "INV-7", "amount": "lots"}) == (
        "t:job:job: payload.amount is invalid for Invoice: Input should be a valid integer, "
        "unable to parse string as an integer, got 'lots'"
    )


def test_a_nested_field_and_a_bulk_index_are_in_the_path() -> None:
    payload = {"invoice": "INV-7", "amount": 1, "lines": [{"sku": "a", "quantity": 1}, {}]}
    assert refusal(payload, path="payloads[3]") == (
        "t:job:job: payloads[3].lines[1].sku is invalid for Invoice: Field required "
        "(and 1 more error)"
    )


def test_a_missing_field_shows_no_value_so_never_the_payload() -> None:
    secret = "s3cr3t-token"
    text = refusal({"amount": 1, "token": secret})
    assert text == "t:job:job: payload.invoice is invalid for Invoice: Field required"
    assert secret not in text


def test_a_long_bad_value_is_cut() -> None:
    text = refusal({"invoice": "INV-7", "amount": "9" * 500 + "x"})
    assert text.endswith("...'") or text.endswith("...")
    assert len(text) < 300


class Checked(BaseModel):
    a: int
    b: int

    @model_validator(mode="after")
    def ordered(self) -> Checked:
        if self.a > self.b:
            raise ValueError("a must not\nexceed b")
        return self


def test_a_model_level_error_shows_no_value_and_keeps_one_line() -> None:
    def handler(payload: Checked, ctx: JobContext) -> None:
        pass

    assert refusal({"a": 2, "b": 1, "secret": "x" * 50}, handler) == (
        "t:job:job: payload is invalid for Checked: Value error, a must not exceed b"
    )


def test_an_instance_of_another_model_or_a_non_object_is_refused() -> None:
    assert refusal(Other(invoice="x", amount=1)) == (
        "t:job:job: payload must be a dict or an instance of Invoice, not Other"
    )
    assert refusal([1, 2]) == (
        "t:job:job: payload must be a JSON object (dict) or an instance of Invoice, got [1, 2]"
    )


def test_an_instance_built_without_validation_is_validated() -> None:
    built = Invoice.model_construct(invoice="INV-7", amount="lots")
    assert refusal(built).startswith("t:job:job: payload.amount is invalid for Invoice:")


class Aliased(BaseModel):
    amount: int = Field(alias="Amount")


class Both(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    amount: int = Field(alias="Amount")


def test_a_model_that_refuses_its_own_dump_is_refused_at_the_call() -> None:
    def handler(payload: Aliased, ctx: JobContext) -> None:
        pass

    assert refusal({"Amount": 1}, handler) == (
        "t:job:job: payload.Amount is invalid for Aliased: Field required "
        "(Aliased does not accept its own model_dump(mode='json'))"
    )

    def fine(payload: Both, ctx: JobContext) -> None:
        pass

    assert payload_to_enqueue(job_of(fine), {"Amount": 1}, max_bytes=MAX_BYTES) == {"amount": 1}


class Big(BaseModel):
    n: int
    note: str = "x" * 2_000


def test_the_dump_still_passes_kumikos_payload_limits() -> None:
    def handler(payload: Big, ctx: JobContext) -> None:
        pass

    with pytest.raises(PayloadError, match=r"payload\['n'\] must be an integer within"):
        payload_to_enqueue(job_of(handler), {"n": 2**70}, max_bytes=MAX_BYTES)
    with pytest.raises(PayloadError, match=r"payload is too large once encoded"):
        payload_to_enqueue(job_of(handler), {"n": 1}, max_bytes=1_000)


def test_a_queued_payload_that_no_longer_validates_is_refused_with_the_note() -> None:
    job = job_of(typed_handler)
    assert load_payload(job, {"invoice": "INV-7", "amount": 3}) == Invoice(
        invoice="INV-7", amount=3
    )
    with pytest.raises(PayloadError) as caught:
        load_payload(job, {"invoice": "INV-7", "amount": 3.5}, note=STALE_NOTE)
    text = str(caught.value)
    assert text.startswith("t:job:job: payload.amount is invalid for Invoice: Input should be")
    assert text.endswith(
        ", got 3.5 (the queued payload no longer validates: dead-lettered without retry)"
    )


def test_a_workers_refusal_leaves_the_value_out_unless_payloads_are_recorded() -> None:
    job = job_of(typed_handler)
    with pytest.raises(PayloadError) as caught:
        load_payload(job, {"invoice": "INV-7", "amount": "secret-ish"}, show_value=False)
    assert str(caught.value).startswith("t:job:job: payload.amount is invalid for Invoice:")
    assert "secret-ish" not in str(caught.value)


def test_no_retry_makes_any_attempt_the_final_one() -> None:
    meta = JobMeta(attempt=1, max_attempts=4, tenant_id=None, trigger="manual")
    assert not meta.final_attempt
    assert JobMeta(1, 4, None, "manual", no_retry=True).final_attempt


# -- the schema `kumiko jobs` and the dashboard show --------------------------------------------
def test_the_schema_lists_each_field_with_its_type_and_whether_it_is_required() -> None:
    class Address(BaseModel):
        city: str

    class Order(BaseModel):
        id: int
        note: str | None = None
        lines: list[Line] = []
        ship_to: Address
        at: datetime
        kind: str = Field("a", pattern="a|b")
        scores: dict[str, float] = {}

    assert schema_fields(Order) == [
        PayloadField("id", "integer", True),
        PayloadField("note", "string | null", False),
        PayloadField("lines", "array[Line]", False),
        PayloadField("ship_to", "Address", True),
        PayloadField("at", "string (date-time)", True),
        PayloadField("kind", "string", False),
        PayloadField("scores", "object[number]", False),
    ]
    assert PayloadField("id", "integer", True).to_json() == {
        "name": "id",
        "type": "integer",
        "required": True,
    }


def test_schema_types_read_enums_constants_and_unknowns() -> None:
    assert schema_type({"enum": ["a", "b"], "type": "string"}) == '"a" | "b"'
    assert schema_type({"const": 3}) == "3"
    assert schema_type({}) == "any"
    assert schema_type({"type": ["string", "null"]}) == "string | null"
    assert schema_type({"allOf": [{"$ref": "#/$defs/Line"}]}) == "Line"


# -- when dispatch re-validates the dump --------------------------------------------------------
class WithBefore(BaseModel):
    due: str

    @field_validator("due", mode="before")
    @classmethod
    def german(cls, value: Any) -> Any:
        return value


class Strict(BaseModel):
    model_config = ConfigDict(strict=True)
    n: int


class Computed(BaseModel):
    n: int

    @computed_field  # type: ignore[prop-decorator]
    @property
    def double(self) -> int:
        return 2 * self.n


class PathLike(BaseModel):
    where: Path


@pytest.mark.parametrize(
    ("model", "plain"),
    [
        (Invoice, True),
        (Defaults, True),
        (Stamped, True),
        (Checked, True),  # an after-validator sees the validated value: nothing new
        (Aliased, False),
        (Both, False),
        (WithBefore, False),
        (Strict, False),
        (Computed, False),
        (PathLike, False),  # validates Python input differently from JSON
    ],
)
def test_only_a_plain_model_skips_the_check_of_its_dump(
    model: type[BaseModel], plain: bool
) -> None:
    assert is_plain_model(model) is plain


def test_a_plain_model_validates_a_decoded_payload_as_json_mode_would() -> None:
    sample = Stamped(at=datetime(2024, 5, 1, 12, 30, 1, 5, tzinfo=UTC), price=Decimal("9.90"))
    dumped = sample.model_dump(mode="json")
    assert Stamped.model_validate(dumped) == Stamped.model_validate_json(json.dumps(dumped))
    assert Stamped.model_validate(dumped) == sample


def test_a_model_whose_nested_model_is_defined_later_is_completed_by_the_registry() -> None:
    assert not OUTER_COMPLETE_WHEN_DECLARED
    registry = Registry([outer])
    assert registry.jobs["outer:job:job"].payload_model is Outer
    assert run_job(registry, "outer:job:job", {"inner": {"n": 1}}) == Outer(inner=Inner(n=1))


class Outer(BaseModel):
    inner: Inner


def outer_handler(payload: Outer, ctx: JobContext) -> Outer:
    return payload


outer = Feature("outer")
outer.job("job")(outer_handler)
OUTER_COMPLETE_WHEN_DECLARED = Outer.__pydantic_complete__


class Inner(BaseModel):
    n: int


class Broken(BaseModel):
    part: NeverDefined  # type: ignore[name-defined]  # noqa: F821


def test_a_model_that_cannot_be_completed_is_a_config_error() -> None:
    def handler(payload: Broken, ctx: JobContext) -> None:
        pass

    feature = Feature("broken")
    feature.job("job")(handler)
    with pytest.raises(JobConfigError, match=r"broken:job:job: payload model Broken is not fully"):
        Registry([feature])
