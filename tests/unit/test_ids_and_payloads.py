"""Deterministic ids and payload checks: pure functions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from kumiko_dramatiq import PayloadError
from kumiko_dramatiq.ids import boot_message_id, child_message_id, cron_tick_id
from kumiko_dramatiq.limits import check_payload


def test_child_ids_are_deterministic() -> None:
    assert child_message_id("w1", "t1") == child_message_id("w1", "t1")


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("a:b", "c"), ("a", "b:c")),
        (("a", "bc"), ("ab", "c")),
        (("a\x00", "b"), ("a", "\x00b")),
        (('a","', "b"), ("a", '","b')),
    ],
)
def test_child_ids_do_not_collide_when_separators_move(
    a: tuple[str, str], b: tuple[str, str]
) -> None:
    assert child_message_id(*a) != child_message_id(*b)


def test_boot_ids_depend_on_job_and_prefix() -> None:
    assert boot_message_id("f:job:a", "p1") == boot_message_id("f:job:a", "p1")
    assert boot_message_id("f:job:a", "p1") != boot_message_id("f:job:a", "p2")
    assert boot_message_id("f:job:a", "p1") != boot_message_id("f:job:b", "p1")


def test_cron_tick_ids_identify_the_instant_not_the_zone() -> None:
    utc = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    plus_one = utc.astimezone(timezone(timedelta(hours=1)))
    assert cron_tick_id("f:job:a", utc) == cron_tick_id("f:job:a", plus_one)
    assert cron_tick_id("f:job:a", utc) != cron_tick_id("f:job:a", utc + timedelta(seconds=1))
    with pytest.raises(ValueError, match="aware"):
        cron_tick_id("f:job:a", datetime(2026, 11, 29, 12, 0))


def test_none_is_an_empty_payload() -> None:
    assert check_payload("f:job:a", None, max_bytes=1024) == {}


@pytest.mark.parametrize(
    ("payload", "path"),
    [
        ([1, 2], "payload"),
        ("text", "payload"),
        ({"when": datetime(2026, 1, 1)}, "payload['when']"),
        ({"n": float("nan")}, "payload['n']"),
        ({"items": [1, {2, 3}]}, "payload['items'][1]"),
        ({1: "a"}, "payload"),
        ({"deep": {"x": object()}}, "payload['deep']['x']"),
    ],
)
def test_a_bad_payload_names_the_job_and_the_path(payload: Any, path: str) -> None:
    with pytest.raises(PayloadError) as caught:
        check_payload("f:job:a", payload, max_bytes=1024)
    assert str(caught.value).startswith(f"f:job:a: {path} ")
    assert "got" in str(caught.value)


def test_json_values_pass() -> None:
    payload = {"a": [1, 2.5, "x", None, True, {"b": []}]}
    assert check_payload("f:job:a", payload, max_bytes=1024) is payload
