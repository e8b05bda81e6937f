"""Job options: every validation error names the job, the option and the bad value."""

from __future__ import annotations

from typing import Any

import pytest

from kumiko_dramatiq import (
    Backoff,
    Cron,
    Event,
    Feature,
    JobConfigError,
    JobContext,
    KumikoError,
    Manual,
    Registry,
    Retention,
    build_message_options,
)
from kumiko_dramatiq.codec import KumikoOptions
from kumiko_dramatiq.options import retry_delay_ms, retry_window_ms


def handler(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


def declare(**options: Any) -> Registry:
    feature = Feature("billing")
    feature.job("send_invoice", **options)(handler)
    return Registry([feature])


@pytest.mark.parametrize(
    ("options", "field", "shown"),
    [
        ({"retries": -1}, "retries", "-1"),
        ({"retries": True}, "retries", "True"),
        ({"retries": 2.0}, "retries", "2.0"),
        ({"retries": "3"}, "retries", "'3'"),
        ({"backoff": "linear"}, "backoff.type", "'linear'"),
        ({"backoff": 5}, "backoff", "5"),
        ({"backoff": Backoff("fixed", delay_ms=0)}, "backoff.delay_ms", "0"),
        ({"backoff": Backoff("fixed", delay_ms=-5)}, "backoff.delay_ms", "-5"),
        ({"backoff": Backoff("exponential", delay_ms=1.5)}, "backoff.delay_ms", "1.5"),  # type: ignore[arg-type]
        ({"backoff": Backoff("exponential", delay_ms=True)}, "backoff.delay_ms", "True"),
        ({"per_tenant": 1}, "per_tenant", "1"),
        ({"concurrency": "serial"}, "concurrency", "'serial'"),
        ({"run_on_boot": "yes"}, "run_on_boot", "'yes'"),
        ({"boot_gate": None}, "boot_gate", "None"),
        ({"run_in": "cpu"}, "run_in", "'cpu'"),
        ({"timeout_ms": 0}, "timeout_ms", "0"),
        ({"timeout_ms": 1.5}, "timeout_ms", "1.5"),
        ({"trigger": "cron"}, "trigger", "'cron'"),
        ({"trigger": Event("")}, "trigger.name", "''"),
        ({"trigger": Event("paid", dedup_key="k")}, "trigger.dedup_key", "'k'"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_option_names_the_job_the_option_and_the_value(
    options: dict[str, Any], field: str, shown: str
) -> None:
    with pytest.raises(JobConfigError) as caught:
        declare(**options)
    message = str(caught.value)
    assert message.startswith("billing:job:send_invoice: ")
    assert field in message
    assert message.endswith(f"got {shown}")
    assert "\n" not in message


def test_backoff_delay_ms_error_uses_the_contract_wording() -> None:
    with pytest.raises(JobConfigError, match=r"backoff\.delay_ms must be a positive integer"):
        declare(backoff=Backoff("fixed", delay_ms=0))


def test_an_unknown_option_is_named() -> None:
    with pytest.raises(
        JobConfigError, match=r"billing:job:send_invoice: retry is not a job option"
    ):
        declare(retry=3)


def test_boot_gate_with_sequential_concurrency_is_rejected() -> None:
    with pytest.raises(JobConfigError, match="boot_gate with concurrency"):
        declare(boot_gate=True, concurrency="sequential")


@pytest.mark.parametrize("name", ["", "1abc", "a:b", "a b", None])
def test_feature_and_job_names_must_be_identifiers(name: Any) -> None:
    with pytest.raises(JobConfigError, match="must match"):
        Feature(name)
    with pytest.raises(JobConfigError, match="must match"):
        Feature("ok").job(name)


def test_duplicate_qualified_names_across_features_are_rejected() -> None:
    first, second = Feature("billing"), Feature("billing")
    first.job("send")(handler)
    second.job("send")(handler)
    with pytest.raises(JobConfigError, match="billing:job:send"):
        Registry([first, second])


def test_the_decorator_returns_the_handler_unchanged() -> None:
    feature = Feature("billing")
    assert feature.job("send")(handler) is handler
    job = Registry([feature]).jobs["billing:job:send"]
    assert job.qualified_name == "billing:job:send"
    assert job.handler is handler
    assert job.options.trigger == Manual()


def test_errors_are_kumiko_and_value_errors() -> None:
    with pytest.raises(KumikoError):
        declare(retries=-1)
    with pytest.raises(ValueError, match="retries"):
        declare(retries=-1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("completed_age_s", 0),
        ("completed_age_s", True),
        ("failed_age_s", -1),
        ("failed_age_s", 1.0),
    ],
)
def test_retention_fields_must_be_positive_integers(field: str, value: Any) -> None:
    with pytest.raises(JobConfigError, match=rf"retention\.{field} must be a positive integer"):
        Retention(**{field: value})


def test_message_options_are_json_native_and_deterministic() -> None:
    registry = declare(retries=3, backoff="exponential")
    job = registry.jobs["billing:job:send_invoice"]
    options = build_message_options(job)
    assert options == {
        "kumiko_retries": 3,
        "kumiko_backoff": "exponential",
        "kumiko_backoff_delay_ms": 1000,
    }
    assert build_message_options(job) == options


def test_message_options_without_backoff() -> None:
    job = declare().jobs["billing:job:send_invoice"]
    assert build_message_options(job) == {
        "kumiko_retries": 0,
        "kumiko_backoff": None,
        "kumiko_backoff_delay_ms": None,
    }


@pytest.mark.parametrize(
    ("backoff", "delays"),
    [
        (Backoff("fixed", delay_ms=250), [250, 250, 250, 250]),
        (Backoff("exponential", delay_ms=100), [100, 200, 400, 800]),
        ("fixed", [1000, 1000, 1000, 1000]),
        ("exponential", [1000, 2000, 4000, 8000]),
        (None, [None, None, None, None]),
    ],
)
def test_retry_delays_follow_the_contract(backoff: Any, delays: list[int | None]) -> None:
    job = declare(retries=4, backoff=backoff).jobs["billing:job:send_invoice"]
    # The delays as a worker computes them from the message options
    options = KumikoOptions.decode({**build_message_options(job), "kumiko_trigger": "manual"})
    assert [
        retry_delay_ms(options.backoff, options.backoff_delay_ms, n) for n in (1, 2, 3, 4)
    ] == delays


@pytest.mark.parametrize(
    ("retries", "backoff", "window_ms"),
    [
        (3, Backoff("fixed", delay_ms=500), 1500),
        (3, Backoff("exponential", delay_ms=500), 3500),
        (3, None, 0),
        (0, "exponential", 0),
    ],
)
def test_retry_window(retries: int, backoff: Any, window_ms: int) -> None:
    job = declare(retries=retries, backoff=backoff).jobs["billing:job:send_invoice"]
    assert retry_window_ms(job.options) == window_ms


def test_triggers_are_accepted() -> None:
    feature = Feature("billing")
    feature.job("a", trigger=Cron("*/5 * * * *"))(handler)
    feature.job("b", trigger=Event("invoice.paid"))(handler)
    registry = Registry([feature])
    assert [job.name for job in registry.jobs_for_event("invoice.paid")] == ["b"]
