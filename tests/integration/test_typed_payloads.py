"""Typed payloads on a real Redis: every enqueue path validates a job's model before writing
anything and enqueues its JSON dump; the handler receives the model; a queued payload that no
longer validates is dead-lettered at once with the error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import date
from pathlib import Path
from typing import Any

import pytest
import redis
from dramatiq.message import Message
from pydantic import BaseModel
from starlette.testclient import TestClient

from examples.billing.app import registry as billing_registry
from kumiko_dramatiq import Cron, Event, Feature, JobContext, PayloadError, Registry
from kumiko_dramatiq.broker.keys import queue_messages
from kumiko_dramatiq.dashboard import create_app
from tests.conftest import Recorder, RunnerFactory, wait_for

ROOT = Path(__file__).resolve().parents[2]


class Line(BaseModel):
    sku: str
    quantity: int


class Invoice(BaseModel):
    invoice: str
    amount: int
    due: date
    lines: list[Line] = []


class Nightly(BaseModel):
    currency: str = "EUR"


class Seen:
    """What handlers received, handed to them as ``ctx.app``."""

    def __init__(self) -> None:
        self.payloads: list[tuple[str, str | None, Any]] = []

    def add(self, ctx: JobContext, payload: Any) -> None:
        self.payloads.append((ctx.job_name, ctx.tenant_id, payload))

    def of(self, job_name: str) -> list[Any]:
        return [payload for name, _, payload in self.payloads if name == job_name]


def charge(payload: Invoice, ctx: JobContext) -> None:
    ctx.app.add(ctx, payload)


async def charge_async(payload: Invoice, ctx: JobContext) -> None:
    ctx.app.add(ctx, payload)


def audit(payload: dict[str, Any], ctx: JobContext) -> None:
    ctx.app.add(ctx, payload)


def nightly(payload: Nightly, ctx: JobContext) -> None:
    ctx.app.add(ctx, payload)


NO_TENANTS: dict[str, Any] = {"get_active_tenant_ids": lambda: []}


def registry(dedup_seen: list[Any] | None = None) -> Registry:
    shop = Feature("shop")
    shop.job("charge", retries=2)(charge)
    shop.job("charge_async")(charge_async)
    shop.job("charge_tenants", per_tenant=True)(charge)
    shop.job("on_paid", trigger=Event("invoice.paid"))(charge)

    def key(payload: dict[str, Any]) -> str:
        if dedup_seen is not None:
            dedup_seen.append(payload)
        return str(payload["invoice"])

    shop.job("audit_paid", trigger=Event("invoice.paid", dedup_key=key))(audit)
    return Registry([shop])


INVOICE = {"invoice": "INV-7", "amount": "12", "due": "2024-05-01"}
DUMPED = {"invoice": "INV-7", "amount": 12, "due": "2024-05-01", "lines": []}
MODEL = Invoice(invoice="INV-7", amount=12, due=date(2024, 5, 1))


def queued(client: redis.Redis, prefix: str) -> list[Message[Any]]:
    raws: list[bytes] = client.hvals(queue_messages(f"{prefix}-worker"))  # type: ignore[assignment]
    return [Message.decode(raw) for raw in raws]


def nothing_written(client: redis.Redis, prefix: str) -> bool:
    return not queued(client, prefix) and not list(client.scan_iter(match=f"kumiko:{prefix}:*"))


# -- dispatch -----------------------------------------------------------------------------------
def test_dispatch_enqueues_the_models_json_dump_and_the_handler_receives_the_model(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    seen = Seen()
    runner = make_runner(registry(), context=seen, **NO_TENANTS)
    from_dict = runner.dispatch("shop:job:charge", INVOICE)
    from_model = runner.dispatch("shop:job:charge", MODEL)
    # The queue holds what model_dump(mode="json") gives, for a dict and an instance alike
    assert {str(m.message_id): m.args[0] for m in queued(redis_client, prefix)} == {
        from_dict: DUMPED,
        from_model: DUMPED,
    }
    runner.start()
    assert [run.status for run in runner.drain()] == ["completed", "completed"]
    received = seen.of("shop:job:charge")
    assert all(type(each) is Invoice for each in received)
    assert received == [MODEL, MODEL]


def test_an_async_handler_receives_the_model(make_runner: RunnerFactory) -> None:
    seen = Seen()
    runner = make_runner(registry(), context=seen, **NO_TENANTS)
    runner.start()
    runner.dispatch("shop:job:charge_async", INVOICE)
    assert [run.status for run in runner.drain()] == ["completed"]
    assert seen.of("shop:job:charge_async") == [MODEL]


def test_dispatch_refuses_a_bad_payload_naming_the_job_and_field_and_writes_nothing(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry(), **NO_TENANTS)
    bad = {**INVOICE, "lines": [{"sku": "A", "quantity": 1}, {"sku": "B", "quantity": "two"}]}
    with pytest.raises(PayloadError) as caught:
        runner.dispatch("shop:job:charge", bad, dedup_key="k")
    assert str(caught.value).startswith(
        "shop:job:charge: payload.lines[1].quantity is invalid for Invoice: Input should be a "
        "valid integer"
    )
    assert str(caught.value).endswith(", got 'two'")
    assert nothing_written(redis_client, prefix)


# -- dispatch_many ------------------------------------------------------------------------------
def test_dispatch_many_names_the_index_and_field_of_a_bad_payload_and_enqueues_nothing(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry(), **NO_TENANTS)
    payloads: list[Any] = [INVOICE, MODEL, INVOICE, {**INVOICE, "amount": "lots"}, INVOICE]
    with pytest.raises(PayloadError, match=r"^shop:job:charge: payloads\[3\]\.amount is invalid"):
        runner.dispatch_many("shop:job:charge", payloads)
    with pytest.raises(PayloadError, match=r"^shop:job:charge: payloads\[1\]\.due is invalid"):
        runner.dispatch_many("shop:job:charge", [INVOICE, {**INVOICE, "due": "soon"}])
    assert nothing_written(redis_client, prefix)


def test_dispatch_many_of_dicts_and_instances_runs_each_with_the_model(
    make_runner: RunnerFactory,
) -> None:
    seen = Seen()
    runner = make_runner(registry(), context=seen, **NO_TENANTS)
    ids = runner.dispatch_many("shop:job:charge", [INVOICE, MODEL], dedup_keys=["a", "b"])
    runner.start()
    assert sorted(run.message_id for run in runner.drain()) == sorted(ids)
    assert seen.of("shop:job:charge") == [MODEL, MODEL]


# -- handle_event -------------------------------------------------------------------------------
def test_an_event_validates_its_typed_job_before_enqueuing_any_job(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry(), **NO_TENANTS)
    with pytest.raises(PayloadError, match=r"^shop:job:on_paid: payload\.due is invalid"):
        runner.handle_event("invoice.paid", {"invoice": "INV-7", "amount": 1})
    assert nothing_written(redis_client, prefix)


def test_an_event_gives_the_typed_job_its_model_and_the_untyped_one_and_its_key_the_dict(
    make_runner: RunnerFactory,
) -> None:
    seen, keyed = Seen(), list[Any]()
    runner = make_runner(registry(keyed), context=seen, **NO_TENANTS)
    runner.start()
    runner.handle_event("invoice.paid", INVOICE)
    runner.handle_event("invoice.paid", MODEL.model_copy(update={"invoice": "INV-8"}))
    assert len(runner.drain()) == 4
    # (the two events' runs of one job may start in either order: the worker has threads)
    typed = sorted(seen.of("shop:job:on_paid"), key=lambda model: str(model.invoice))
    assert typed == [MODEL, MODEL.model_copy(update={"invoice": "INV-8"})]
    # The untyped job and the dedup key function get the event's dict (an instance: its dump)
    untyped = sorted(seen.of("shop:job:audit_paid"), key=lambda payload: str(payload["invoice"]))
    assert untyped == [INVOICE, {**DUMPED, "invoice": "INV-8"}]
    assert keyed == [INVOICE, {**DUMPED, "invoice": "INV-8"}]


# -- per tenant, cron, boot ---------------------------------------------------------------------
def test_each_per_tenant_child_receives_the_model(make_runner: RunnerFactory) -> None:
    seen = Seen()
    runner = make_runner(registry(), context=seen, get_active_tenant_ids=lambda: ["acme", "bolt"])
    runner.start()
    runner.dispatch("shop:job:charge_tenants", INVOICE)
    assert len(runner.drain()) == 3  # the wrapper and two children
    children = [(t, p) for n, t, p in seen.payloads if n == "shop:job:charge_tenants"]
    assert sorted(children, key=lambda each: str(each[0])) == [("acme", MODEL), ("bolt", MODEL)]


def test_a_typed_cron_tick_runs_with_the_models_defaults(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    seen = Seen()
    feature = Feature("cron")
    feature.job("tick", trigger=Cron("* * * * * *"))(nightly)
    runner = make_runner(
        Registry([feature]),
        context=seen,
        run_scheduler=True,
        record_payloads=True,
        **recorder.hooks(),
    )
    runner.start()
    recorder.wait_until(lambda r: bool(r.of("complete")), what="a completed tick")
    assert seen.of("cron:job:tick")[0] == Nightly()
    # the hook runs before the settle that writes the record
    message_id = recorder.of("complete")[0].message_id
    wait_for(
        lambda: [run.status for run in runner.run_record(message_id)] == ["completed"],
        what="the tick's run record (the settle lands after the hook)",
    )
    (run,) = runner.run_record(message_id)
    assert run.payload == {"currency": "EUR"}  # what the tick enqueued: the defaults' dump


def test_a_typed_boot_once_job_and_boot_gate_receive_their_models(
    make_runner: RunnerFactory,
) -> None:
    seen = Seen()
    feature = Feature("boot")
    feature.job("once", run_on_boot=True)(nightly)
    feature.job("gate", boot_gate=True)(nightly)
    runner = make_runner(Registry([feature]), context=seen)
    runner.start()  # the gate runs in start(), the boot-once job on the worker
    runner.drain()
    assert seen.of("boot:job:gate") == [Nightly()]
    assert seen.of("boot:job:once") == [Nightly()]


# -- a queued payload that no longer validates --------------------------------------------------
class InvoiceV2(BaseModel):
    invoice: str
    amount: int
    currency: str  # new and required: what was queued before has none


def charge_v2(payload: InvoiceV2, ctx: JobContext) -> None:
    ctx.app.add(ctx, payload)


def test_a_queued_payload_that_no_longer_validates_is_dead_lettered_at_once(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    # Given payloads queued by the old code (the model had no `currency`)
    producer = make_runner(registry(), **NO_TENANTS)
    old_id = producer.dispatch("shop:job:charge", INVOICE, dedup_key="INV-7")
    # When a worker of the new code (retries=2, as before) runs them
    shop = Feature("shop")
    shop.job("charge", retries=2)(charge_v2)
    seen = Seen()
    worker = make_runner(Registry([shop]), context=seen, **recorder.hooks())
    worker.start()
    runs = worker.drain()
    # Then the handler never ran, and no retry was spent: one attempt, dead
    assert seen.payloads == []
    assert [(r.message_id, r.attempt, r.max_attempts, r.status) for r in runs] == [
        (old_id, 1, 3, "dead")
    ]
    expected = (
        "shop:job:charge: payload.currency is invalid for InvoiceV2: Field required (the "
        "queued payload no longer validates: dead-lettered without retry)"
    )
    assert (runs[0].error_type, runs[0].error_message) == ("PayloadError", expected)
    (letter,) = worker.dead_letters("shop:job:charge")
    assert (letter.message_id, letter.error_type, letter.error_message) == (
        old_id,
        "PayloadError",
        expected,
    )
    # The hooks saw a final attempt; its dedup key is free again
    (failed,) = recorder.of("failed")
    assert failed.meta.final_attempt
    assert failed.meta.no_retry
    fresh = {"invoice": "INV-7", "amount": 1, "currency": "EUR"}
    assert worker.dispatch("shop:job:charge", fresh, dedup_key="INV-7") != old_id


def test_a_stale_per_tenant_wrapper_is_dead_lettered_before_any_child(
    make_runner: RunnerFactory,
) -> None:
    producer = make_runner(registry(), **NO_TENANTS)
    wrapper_id = producer.dispatch("shop:job:charge_tenants", INVOICE)
    shop = Feature("shop")
    shop.job("charge_tenants", per_tenant=True, retries=1)(charge_v2)
    seen = Seen()
    worker = make_runner(Registry([shop]), context=seen, get_active_tenant_ids=lambda: ["acme"])
    worker.start()
    runs = worker.drain()
    assert [(r.message_id, r.tenant_id, r.attempt, r.status) for r in runs] == [
        (wrapper_id, None, 1, "dead")
    ]
    assert seen.payloads == []


# -- operating: `kumiko jobs` and the dashboard show the schema ---------------------------------
def kumiko(redis_url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT),
        KUMIKO_APP="examples.billing.app:registry",
        KUMIKO_REDIS_URL=redis_url,
        KUMIKO_QUEUE_PREFIX=prefix,
    )
    return subprocess.run(
        [sys.executable, "-m", "kumiko_dramatiq.ops.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_kumiko_jobs_shows_each_typed_jobs_payload_fields(redis_url: str, prefix: str) -> None:
    listed = kumiko(redis_url, prefix, "jobs", "--json")
    assert listed.returncode == 0, listed.stderr
    jobs = {job["name"]: job for job in json.loads(listed.stdout)["jobs"]}
    send = jobs["billing:job:send_invoice"]
    assert send["payload_model"] == "Invoice"
    assert send["payload_schema"] == [
        {"name": "invoice", "type": "string", "required": True},
        {"name": "email", "type": "string", "required": True},
        {"name": "gateway_failures", "type": "integer", "required": False},
    ]
    assert jobs["billing:job:render_pdf"]["payload_model"] is None
    assert jobs["billing:job:render_pdf"]["payload_schema"] is None

    text = kumiko(redis_url, prefix, "jobs")
    assert text.returncode == 0, text.stderr
    rows = [line.split() for line in text.stdout.splitlines()]
    assert ["typed", "job", "payload", "model", "field", "type", "required"] in rows
    assert ["billing:job:send_invoice", "Invoice", "invoice", "string", "yes"] in rows
    assert ["gateway_failures", "integer", "no"] in rows


def test_the_dashboards_jobs_page_shows_each_typed_jobs_payload_fields(
    make_runner: RunnerFactory,
) -> None:
    page = TestClient(create_app(make_runner(billing_registry))).get("/jobs").text
    assert '<summary class="mono">Invoice</summary>' in page
    assert '<span class="mono">gateway_failures: integer</span>' in page
    assert '<span class="mono">amount: number</span> <span class="muted">required</span>' in page
