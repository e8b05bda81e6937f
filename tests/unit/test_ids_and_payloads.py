"""Deterministic ids and payload checks: pure functions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from kumiko_dramatiq import PayloadError
from kumiko_dramatiq.ids import (
    boot_message_id,
    child_message_id,
    cron_tick_id,
    handoff_redis_id,
    redis_id_candidates,
    redis_message_id,
)
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


def test_each_live_copy_of_a_message_id_has_its_own_derived_redis_id() -> None:
    first = redis_message_id("m1")
    retries = [redis_message_id("m1", attempt) for attempt in (2, 3, 4)]
    assert len({first, *retries, redis_message_id("m2")}) == 5
    assert redis_message_id("m1") == first  # deterministic


def test_a_hand_off_never_takes_the_redis_id_of_the_delivery_that_writes_it() -> None:
    one = handoff_redis_id("origin", redis_message_id("origin"))
    two = handoff_redis_id("origin", one)
    assert one != two
    assert handoff_redis_id("origin", two) == one  # they alternate
    assert one not in (redis_message_id("origin"), handoff_redis_id("other", "x"))


def test_the_candidates_of_an_id_cover_its_first_write_its_next_retries_and_its_hand_offs() -> None:
    never_ran = redis_id_candidates("m1", 0)
    assert redis_message_id("m1") in never_ran
    assert redis_message_id("m1", 2) in never_ran  # a retry written while the caller read
    after_two = redis_id_candidates("m1", 2)
    assert {redis_message_id("m1", 3), redis_message_id("m1", 4)} <= set(after_two)
    hand_off = handoff_redis_id("m1", redis_message_id("m1"))
    assert hand_off in after_two
    assert handoff_redis_id("m1", hand_off) in after_two
    assert len(redis_id_candidates("m1", 9_999)) == 5  # bounded, however often it retried


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
