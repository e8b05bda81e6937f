"""The pure decisions behind dedup keys: the record's TTL bound, delivery outcomes, event keys."""

from __future__ import annotations

from typing import Any

import pytest

from kumiko_dramatiq import Backoff, Event, Feature, JobContext, PayloadError, Registry
from kumiko_dramatiq.middleware.dedup import (
    DEFAULT_RUN_BOUND_MS,
    QUEUE_SLACK_MS,
    TIMEOUT_GRACE_MS,
    delivery_outcome,
    event_dedup_keys,
    job_record_ttl_ms,
    record_ttl_ms,
)


def noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


def job_with(**options: Any) -> Any:
    feature = Feature("u")
    feature.job("j", **options)(noop)
    return Registry([feature]).jobs["u:job:j"]


# -- the TTL bound ----------------------------------------------------------------
def test_ttl_of_a_job_with_a_timeout_covers_every_attempt_its_backoffs_and_the_slack() -> None:
    ttl_ms = record_ttl_ms(
        timeout_ms=30_000, max_attempts=4, retry_window_ms=7_000, heartbeat_timeout_ms=60_000
    )

    assert ttl_ms == 4 * (30_000 + TIMEOUT_GRACE_MS + 60_000) + 7_000 + QUEUE_SLACK_MS


def test_ttl_of_a_job_without_a_timeout_uses_the_default_run_bound() -> None:
    ttl_ms = record_ttl_ms(
        timeout_ms=None, max_attempts=1, retry_window_ms=0, heartbeat_timeout_ms=60_000
    )

    assert ttl_ms == DEFAULT_RUN_BOUND_MS + 60_000 + QUEUE_SLACK_MS


def test_ttl_of_a_delayed_dispatch_adds_the_delay() -> None:
    base = record_ttl_ms(
        timeout_ms=1_000, max_attempts=1, retry_window_ms=0, heartbeat_timeout_ms=0
    )

    delayed = record_ttl_ms(
        timeout_ms=1_000, max_attempts=1, retry_window_ms=0, heartbeat_timeout_ms=0, delay_ms=5_000
    )

    assert delayed == base + 5_000


def test_ttl_is_always_positive_and_finite() -> None:
    ttl_ms = record_ttl_ms(timeout_ms=1, max_attempts=0, retry_window_ms=0, heartbeat_timeout_ms=0)

    assert 0 < ttl_ms < 10 * QUEUE_SLACK_MS


def test_ttl_rejects_a_negative_quantity() -> None:
    with pytest.raises(ValueError, match="delay_ms must be >= 0"):
        record_ttl_ms(
            timeout_ms=1, max_attempts=1, retry_window_ms=0, heartbeat_timeout_ms=0, delay_ms=-1
        )


def test_job_ttl_reads_timeout_attempts_and_retry_window_from_the_job() -> None:
    job = job_with(timeout_ms=2_000, retries=3, backoff=Backoff("exponential", delay_ms=100))

    ttl_ms = job_record_ttl_ms(job, heartbeat_timeout_ms=10_000)

    assert ttl_ms == record_ttl_ms(
        timeout_ms=2_000, max_attempts=4, retry_window_ms=700, heartbeat_timeout_ms=10_000
    )


def test_job_ttl_of_a_per_tenant_job_bounds_its_wrapper_which_has_no_time_limit() -> None:
    job = job_with(timeout_ms=2_000, per_tenant=True)

    ttl_ms = job_record_ttl_ms(job, heartbeat_timeout_ms=0)

    assert ttl_ms == DEFAULT_RUN_BOUND_MS + QUEUE_SLACK_MS


# -- how a delivery ends --------------------------------------------------------------
@pytest.mark.parametrize(
    ("handed_off", "failed", "final_attempt", "expected"),
    [
        (False, False, False, "end"),  # success before the last attempt
        (False, False, True, "end"),  # success on the last attempt
        (False, True, True, "end"),  # failed for good
        (False, True, False, "retry"),  # a retry keeps the key
        (True, False, False, "handoff"),  # a sequential hand-off moves the key
        (True, True, True, "handoff"),
    ],
)
def test_delivery_outcome(
    handed_off: bool, failed: bool, final_attempt: bool, expected: str
) -> None:
    outcome = delivery_outcome(handed_off=handed_off, failed=failed, final_attempt=final_attempt)

    assert outcome == expected


# -- event keys ------------------------------------------------------------------------
def test_event_keys_are_computed_for_keyed_jobs_only() -> None:
    keyed = job_with(trigger=Event("e", dedup_key=lambda p: f"preempt:{p['project']}"))
    plain = job_with(trigger=Event("e"))

    assert event_dedup_keys([plain, keyed], {"project": 7}) == [None, "preempt:7"]


@pytest.mark.parametrize("bad", ["", 3, None, b"bytes"])
def test_an_event_key_that_is_not_a_non_empty_string_is_a_payload_error(bad: Any) -> None:
    job = job_with(trigger=Event("e", dedup_key=lambda p: bad))

    with pytest.raises(PayloadError, match=r"u:job:j: trigger\.dedup_key must be a non-empty"):
        event_dedup_keys([job], {})


def test_a_key_function_that_raises_is_a_payload_error_naming_the_job() -> None:
    job = job_with(trigger=Event("e", dedup_key=lambda p: p["project"]))

    with pytest.raises(PayloadError, match=r"u:job:j: trigger\.dedup_key raised KeyError"):
        event_dedup_keys([job], {"other": 1})
