"""Deterministic ids and payload checks: pure functions."""

from __future__ import annotations

import json
import random
import uuid
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
from kumiko_dramatiq.messages import new_message_id

#: Characters that JSON escapes or encodes in several bytes: quotes, controls, non-ASCII,
#: beyond the Basic Multilingual Plane, a lone surrogate.
_AWKWARD = 'ab"\\\n\x00\x1fé€\u2028😀\U0010ffff\ud800'


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(_AWKWARD) for _ in range(rng.randint(0, 12)))


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


def test_derived_ids_are_uuid5_over_the_json_array_of_their_parts() -> None:
    # the fast derivation must give the very ids ``uuid.uuid5`` gave: they are stored
    namespace = uuid.UUID("6f1c1d2e-8a43-5b7e-9c1a-4b5d8e2f7a90")

    def reference(*parts: str) -> str:
        return str(uuid.uuid5(namespace, json.dumps(list(parts), ensure_ascii=False)))

    rng = random.Random(33)
    for _ in range(2_000):
        a, b = (_random_text(rng).replace("\ud800", "") for _ in range(2))
        assert child_message_id(a, b) == reference("child", a, b)
        assert redis_message_id(a) == reference("redis", a, "")
        assert redis_message_id(a, 7) == reference("redis", a, "7")
        assert handoff_redis_id(a, "x") == reference("redis-handoff", a, "0")


def test_a_new_message_id_is_a_random_uuid4() -> None:
    drawn = {new_message_id() for _ in range(1_000)}
    assert len(drawn) == 1_000
    for each in drawn:
        parsed = uuid.UUID(each)
        assert (parsed.version, parsed.variant, str(parsed)) == (4, uuid.RFC_4122, each)


def test_a_payload_is_measured_exactly_when_its_walk_cannot_rule_out_too_large() -> None:
    # the walk's bound skips the encoding only when the payload surely fits: check it
    # against the real size on payloads of awkward characters, at and around the limit
    rng = random.Random(33)
    for _ in range(2_000):
        payload: dict[str, Any] = {
            _random_text(rng).replace("\ud800", ""): rng.choice(
                [
                    _random_text(rng).replace("\ud800", ""),
                    rng.randint(-(2**63 - 1), 2**63 - 1),
                    rng.uniform(-1.0, 1.0) * 1e308,
                    -2.2250738585072014e-308,
                    [None, True, {"k": _random_text(rng).replace("\ud800", "")}],
                ]
            )
            for _ in range(rng.randint(0, 5))
        }
        size = len(json.dumps(payload, separators=(",", ":")).encode())
        assert check_payload("f:job:a", payload, max_bytes=size) is payload
        if size > 0:
            with pytest.raises(PayloadError, match="too large once encoded"):
                check_payload("f:job:a", payload, max_bytes=size - 1)


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
