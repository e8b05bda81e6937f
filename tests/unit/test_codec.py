"""kumiko's message options: written by build_message, decoded strictly."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from kumiko_dramatiq import Backoff, Feature, JobContext, Registry
from kumiko_dramatiq.codec import Caps, KumikoOptions, OptionsError, fair_digest
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


def test_priority_and_fair_key_ride_in_the_route_and_a_childs_key_is_its_tenant() -> None:
    job = job_registry().jobs["unit:job:work"]
    wrapper = build_message(job, {}, queue_prefix="p", trigger="manual", priority=4)
    assert wrapper.options["kumiko_route"] == "4"
    child = build_message(job, {}, queue_prefix="p", trigger="fanout", tenant_id="acme")
    keyed = build_message(job, {}, queue_prefix="p", trigger="manual", fair_key="acme")
    assert (
        child.options["kumiko_route"] == keyed.options["kumiko_route"] == f"0.{fair_digest('acme')}"
    )
    assert "kumiko_fair_key" not in child.options
    decoded = KumikoOptions.decode(keyed.options)
    assert (decoded.priority, decoded.fair_key, decoded.route_key) == (0, "acme", "acme")
    assert decoded.encode() == keyed.options
    assert KumikoOptions.decode(child.options).route_key == "acme"


def test_max_running_per_key_rides_in_the_caps() -> None:
    feature = Feature("unit")

    @feature.job("capped", max_running_per_key=3)
    def capped(payload: dict[str, Any], ctx: JobContext) -> None: ...

    job = Registry([feature]).jobs["unit:job:capped"]
    assert job.is_capped
    options = build_message(job, {}, queue_prefix="p", trigger="manual").options
    assert options["kumiko_caps"] == {"per_key": 3}
    assert KumikoOptions.decode(options).caps == Caps(max_running_per_key=3)


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
        ({"kumiko_route": 5}, "kumiko_route"),
        ({"kumiko_route": "10"}, "kumiko_route"),
        ({"kumiko_route": "5.xyz"}, "kumiko_route"),
        ({"kumiko_fair_key": ""}, "kumiko_fair_key"),
        ({"kumiko_caps": {"per_key": 0}}, "kumiko_caps.per_key"),
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
