"""The pure decisions of the Sequential middleware: scope, ids, delays, TTLs."""

from __future__ import annotations

from typing import Any

import pytest

from kumiko_dramatiq import Feature, JobConfigError, JobContext, Registry
from kumiko_dramatiq.environment import resolve_settings
from kumiko_dramatiq.ids import handoff_message_id
from kumiko_dramatiq.middleware.sequential import (
    handoff_delay_ms,
    is_locked,
    lock_tenant,
    new_token,
    renew_interval_ms,
)
from kumiko_dramatiq.registry import JobDefinition


def job(**options: Any) -> JobDefinition:
    feature = Feature("unit")

    @feature.job("work", **options)
    def work(payload: dict[str, Any], ctx: JobContext) -> None: ...

    return Registry([feature]).jobs["unit:job:work"]


def test_only_sequential_jobs_take_the_lock() -> None:
    assert is_locked(job(concurrency="sequential"), is_wrapper=False)
    assert not is_locked(job(), is_wrapper=False)


def test_a_per_tenant_wrapper_takes_no_lock() -> None:
    assert not is_locked(job(concurrency="sequential", per_tenant=True), is_wrapper=True)
    assert is_locked(job(concurrency="sequential", per_tenant=True), is_wrapper=False)


def test_a_per_tenant_job_locks_per_tenant_and_others_globally() -> None:
    assert lock_tenant(job(concurrency="sequential", per_tenant=True), "acme") == "acme"
    assert lock_tenant(job(concurrency="sequential"), "acme") is None


def test_the_hand_off_id_is_deterministic_and_new() -> None:
    assert handoff_message_id("m-1") == handoff_message_id("m-1")
    assert handoff_message_id("m-1") != handoff_message_id("m-2")
    assert handoff_message_id("m-1") != "m-1"
    assert handoff_message_id(handoff_message_id("m-1")) != handoff_message_id("m-1")


@pytest.mark.parametrize("jitter", [0.0, 0.5, 0.999999])
def test_a_hand_off_never_waits_less_than_the_delay_nor_more_than_a_fifth_more(
    jitter: float,
) -> None:
    delay = handoff_delay_ms(1_000, jitter)
    assert 1_000 <= delay < 1_200


def test_leases_are_renewed_three_times_per_ttl() -> None:
    assert renew_interval_ms(30_000) == 10_000
    assert renew_interval_ms(100) == 33


def test_the_lock_ttl_defaults_to_thirty_seconds() -> None:
    assert resolve_settings({}, {}).lock_ttl_ms == 30_000
    assert resolve_settings({}, {"KUMIKO_LOCK_TTL_MS": ""}).lock_ttl_ms == 30_000
    assert resolve_settings({}, {"KUMIKO_LOCK_TTL_MS": "1500"}).lock_ttl_ms == 1_500
    assert resolve_settings({"lock_ttl_ms": 700}, {"KUMIKO_LOCK_TTL_MS": "1500"}).lock_ttl_ms == 700


@pytest.mark.parametrize("raw", ["abc", "99", "-5", "1.5"])
def test_a_bad_lock_ttl_is_a_config_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(JobConfigError, match=r"KUMIKO_LOCK_TTL_MS must be an integer"):
        resolve_settings({}, {"KUMIKO_LOCK_TTL_MS": raw})


def test_tokens_name_their_message_and_never_repeat() -> None:
    first, second = new_token("m-1"), new_token("m-1")
    assert first.startswith("m-1:")
    assert first != second
