"""The settler's decisions and the hold's bounds: pure functions, no Redis, no clock."""

from __future__ import annotations

from typing import Any

import pytest

from kumiko_dramatiq.broker.delivery import RunWrite
from kumiko_dramatiq.broker.holds import (
    HOLD_TTL_MS,
    HoldReply,
    lease_valid_until,
    takeover_after_s,
)
from kumiko_dramatiq.broker.settling import (
    MAX_LINGER_S,
    NO_EXTRAS,
    SETTLE_FIELDS,
    SettleEntry,
    send_in_s,
)
from kumiko_dramatiq.worker.fencing import END_PROCESS_AT


def _due(**changes: Any) -> float:
    values: dict[str, Any] = {
        "now": 100.0,
        "oldest_at": 100.0,
        "gathered": 1,
        "urgent": False,
        "repeat": False,
        "starving": False,
        "job_s": 0.020,
        "threads": 8,
    }
    values.update(changes)
    return send_in_s(**values)


@pytest.mark.parametrize(
    "changes",
    [
        {"urgent": True},
        {"repeat": True},
        {"starving": True},
        {"gathered": 8},
        {"gathered": 1, "threads": 1},
    ],
    ids=["urgent", "a thread's second delivery", "starving", "every thread", "one thread"],
)
def test_a_batch_goes_at_once_when_waiting_buys_nothing(changes: dict[str, Any]) -> None:
    assert _due(**changes) == 0.0


def test_a_batch_of_long_jobs_lingers_at_most_the_bound() -> None:
    # Given deliveries of 50 ms on average, the linger is capped
    assert _due(job_s=0.050) == pytest.approx(MAX_LINGER_S)
    # and counts from the oldest entry: what is left of it
    assert _due(job_s=0.050, now=100.004) == pytest.approx(MAX_LINGER_S - 0.004)
    assert _due(now=100.5) == 0.0


def test_a_batch_of_short_jobs_lingers_about_their_length() -> None:
    assert _due(job_s=0.002) == pytest.approx(0.002)
    assert _due(job_s=0.0) == 0.0


def test_a_hold_lets_held_messages_start_for_three_quarters_of_its_lease() -> None:
    assert lease_valid_until(10.0) == pytest.approx(10.0 + 0.75 * HOLD_TTL_MS / 1000)


def test_a_requester_takes_over_only_after_a_silent_holder_ended_its_unconfirmed_runs() -> None:
    # the fence ends a holder's process at END_PROCESS_AT of the lease after its last renewal
    # was sent, which was before the ask: the takeover comes later, and within 2 s
    assert takeover_after_s() > END_PROCESS_AT * HOLD_TTL_MS / 1000
    assert takeover_after_s() < 2.0


def test_an_entry_without_extras_sends_none() -> None:
    run = RunWrite("m1", 2, "app:job:x", "completed", "", "m1", "{}", "", started_ms=5)
    entry = SettleEntry("r1", "completed", None, "kumiko:p:done:m1", run, "app:job:x")
    fields = entry.fields()
    assert len(fields) == SETTLE_FIELDS
    assert fields == [
        "r1", "completed", "kumiko:p:done:m1", "m1", "2", "app:job:x", "completed", "5", "{}",
        "app:job:x", "",
    ]  # fmt: skip
    assert entry.extras == NO_EXTRAS


def test_an_entry_with_a_slot_and_extras_says_so() -> None:
    extras = ("acme", "", "", "", "", "", "")
    entry = SettleEntry("r1", "ack", ("kumiko:p:slots:j", "r1#1"), "", None, "", extras)
    fields = entry.fields()
    assert fields[1] == "ack kumiko:p:slots:j r1#1"
    assert fields[3:8] == ["", "", "", "", ""]
    assert fields[-1] == "+"


def test_a_hold_reply_decodes_its_asks() -> None:
    reply = HoldReply.decode([[b"r1"], [], [b"r2", b"req\tcancel\t2", b"r3", b"q2\tprobe\t1"]])
    assert reply.revoked == ["r1"]
    assert reply.gone == []
    assert reply.asks == [("r2", "req", "cancel"), ("r3", "q2", "probe")]
