"""Limits on input: every bad value is refused up front, in one line naming job, field, value."""

from __future__ import annotations

from typing import Any

import pytest

from kumiko_dramatiq import Backoff, Feature, JobConfigError, JobContext, PayloadError
from kumiko_dramatiq.limits import (
    MAX_DURATION_MS,
    check_dedup_key,
    check_delay_ms,
    check_payload,
    tenant_id_problem,
)
from kumiko_dramatiq.settings import Settings


def nested(levels: int) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    inner = payload
    for _ in range(levels - 1):
        inner["x"] = {}
        inner = inner["x"]
    return payload


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ({"n": 2**64}, r"payload\['n'\] must be an integer within"),
        ({"n": -(2**63)}, r"payload\['n'\] must be an integer within"),
        (nested(10_000), "payload nests deeper than 100 levels"),
        (nested(101), "payload nests deeper than 100 levels"),
        ({"s": "ok \ud800"}, r"payload\['s'\] must be valid Unicode \(lone surrogate"),
        ({"\udfff": 1}, r"payload key must be valid Unicode"),
        ({"t": (1, 2)}, r"payload\['t'\] must be a JSON value"),
        ({"f": float("inf")}, r"payload\['f'\] must be a finite number"),
        ({"big": "x" * 2_000}, "payload is too large once encoded"),
    ],
)
def test_a_payload_beyond_the_limits_is_one_line_naming_job_and_path(
    payload: dict[str, Any], says: str
) -> None:
    with pytest.raises(PayloadError, match=f"^f:job:a: {says}") as caught:
        check_payload("f:job:a", payload, max_bytes=1_024)
    assert "\n" not in str(caught.value)


def test_a_payload_at_the_limits_passes() -> None:
    payload = {"n": 2**63 - 1, "m": -(2**63 - 1), "deep": nested(99), "s": "ünï €"}
    assert check_payload("f:job:a", payload, max_bytes=1_048_576) is payload


@pytest.mark.parametrize(
    ("delay_ms", "says"),
    [
        (10**30, "delay_ms is too large"),
        (MAX_DURATION_MS + 1, "delay_ms is too large"),
        (-1, "delay_ms must be an integer >= 0"),
        (1.5, "delay_ms must be an integer >= 0"),
        (True, "delay_ms must be an integer >= 0"),
    ],
)
def test_a_bad_delay_is_refused(delay_ms: Any, says: str) -> None:
    with pytest.raises(PayloadError, match=f"f:job:a: {says}"):
        check_delay_ms("f:job:a", delay_ms)


def test_a_delay_of_366_days_is_accepted() -> None:
    assert check_delay_ms("f:job:a", MAX_DURATION_MS) == MAX_DURATION_MS


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("", "must be a non-empty string"),
        (7, "must be a non-empty string"),
        ("k\ud800", "must be valid Unicode"),
        ("k" * 513, "is too long"),
    ],
)
def test_a_bad_dedup_key_is_refused(key: Any, says: str) -> None:
    with pytest.raises(PayloadError, match=f"f:job:a: dedup_key {says}"):
        check_dedup_key("f:job:a", "dedup_key", key)


@pytest.mark.parametrize(
    ("tenant", "says"),
    [
        ("", "must be a non-empty string"),
        (3, "must be a non-empty string"),
        ("t" * 257, "is too long"),
        ("acme\n", "must not contain control characters"),
        ("ac\x00me", "must not contain control characters"),
        ("a\udc80", "must be valid Unicode"),
    ],
)
def test_a_bad_tenant_id_is_named(tenant: Any, says: str) -> None:
    assert tenant_id_problem(tenant) == tenant_id_problem(tenant) is not None
    assert says in str(tenant_id_problem(tenant))


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"retries": 54, "backoff": "exponential"}, "retries/backoff"),
        ({"retries": 3, "backoff": Backoff("fixed", delay_ms=2**62)}, "backoff.delay_ms"),
        ({"timeout_ms": 10**30}, "timeout_ms"),
        ({"retries": 10**6}, "retries"),
    ],
)
def test_a_duration_redis_would_refuse_is_refused_at_declaration(
    options: dict[str, Any], field: str
) -> None:
    feature = Feature("f")
    with pytest.raises(JobConfigError, match=f"f:job:a: {field}.*too large"):

        @feature.job("a", **options)
        def a(payload: dict[str, Any], ctx: JobContext) -> None: ...


@pytest.mark.parametrize(
    "url",
    ["http://x", "redis://h:notaport", "redis://h/abc", "redis://", "redis://h:99999/0", 5],
)
def test_a_bad_redis_url_is_a_config_error(url: Any) -> None:
    with pytest.raises(JobConfigError, match="redis_url"):
        Settings(redis_url=url)


def test_a_password_never_appears_in_a_redis_url_error() -> None:
    with pytest.raises(JobConfigError) as caught:
        Settings(redis_url="redis://user:hunter2@h:notaport/0")
    assert "hunter2" not in str(caught.value)


def test_a_setting_beyond_366_days_is_too_large() -> None:
    with pytest.raises(JobConfigError, match="heartbeat_timeout_ms is too large"):
        Settings(heartbeat_timeout_ms=MAX_DURATION_MS + 1)
