"""kumiko's message options: written by build_message, decoded strictly."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from kumiko_dramatiq import Backoff, Feature, JobContext, Registry
from kumiko_dramatiq.codec import KumikoOptions, OptionsError
from kumiko_dramatiq.messages import build_message


def job_registry() -> Registry:
    feature = Feature("unit")

    @feature.job("work", retries=3, backoff=Backoff("fixed", delay_ms=250), per_tenant=True)
    def work(payload: dict[str, Any], ctx: JobContext) -> None: ...

    return Registry([feature])


def test_what_build_message_writes_decodes_back_to_the_same_options() -> None:
    job = job_registry().jobs["unit:job:work"]
    tick = datetime(2026, 3, 29, 1, 30, tzinfo=UTC)
    message = build_message(
        job,
        {},
        queue_prefix="p",
        trigger="requeue",
        tenant_id="acme",
        failures=2,
        dedup_key="k",
        scheduled_at=tick,
    )
    options = KumikoOptions.decode(message.options)
    assert options == KumikoOptions(
        retries=3,
        backoff="fixed",
        backoff_delay_ms=250,
        trigger="requeue",
        failures=2,
        tenant_id="acme",
        dedup_key="k",
        scheduled_at=tick,
    )
    assert options.encode() == message.options
    assert (options.meta().attempt, options.meta().max_attempts) == (3, 4)


def test_defaults_are_left_out_of_the_message() -> None:
    job = job_registry().jobs["unit:job:work"]
    options = build_message(job, {}, queue_prefix="p", trigger="manual").options
    assert set(options) == {
        "kumiko_retries",
        "kumiko_backoff",
        "kumiko_backoff_delay_ms",
        "kumiko_trigger",
    }


VALID = {
    "kumiko_retries": 2,
    "kumiko_backoff": "exponential",
    "kumiko_backoff_delay_ms": 100,
    "kumiko_trigger": "manual",
}


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"kumiko_retries": None}, "kumiko_retries"),
        ({"kumiko_retries": True}, "kumiko_retries"),
        ({"kumiko_retries": -1}, "kumiko_retries"),
        ({"kumiko_backoff": "bogus"}, "kumiko_backoff"),
        ({"kumiko_backoff_delay_ms": None}, "kumiko_backoff_delay_ms"),
        ({"kumiko_backoff_delay_ms": -5}, "kumiko_backoff_delay_ms"),
        ({"kumiko_backoff_delay_ms": 2.5}, "kumiko_backoff_delay_ms"),
        ({"kumiko_backoff": None}, "kumiko_backoff_delay_ms"),
        ({"kumiko_trigger": "sometimes"}, "kumiko_trigger"),
        ({"kumiko_failures": "1"}, "kumiko_failures"),
        ({"kumiko_failures": 3}, "kumiko_failures"),
        ({"kumiko_tenant_id": 7}, "kumiko_tenant_id"),
        ({"kumiko_tenant_id": ""}, "kumiko_tenant_id"),
        ({"kumiko_dedup_key": ["k"]}, "kumiko_dedup_key"),
        ({"kumiko_scheduled_at": "yesterday"}, "kumiko_scheduled_at"),
        ({"kumiko_scheduled_at": "2026-01-01T00:00:00"}, "kumiko_scheduled_at"),
    ],
)
def test_a_wrong_type_or_range_is_a_decode_error_naming_the_key(
    change: dict[str, Any], key: str
) -> None:
    with pytest.raises(OptionsError, match=f"option {key} "):
        KumikoOptions.decode({**VALID, **change})


@pytest.mark.parametrize("missing", ["kumiko_retries", "kumiko_trigger"])
def test_a_missing_required_key_is_a_decode_error(missing: str) -> None:
    options = {k: v for k, v in VALID.items() if k != missing}
    with pytest.raises(OptionsError, match=missing):
        KumikoOptions.decode(options)


def test_options_that_are_not_an_object_are_a_decode_error() -> None:
    with pytest.raises(OptionsError, match="must be a JSON object"):
        KumikoOptions.decode(["kumiko_retries", 1])
