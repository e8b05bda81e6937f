"""State tables of the scripts that write a message: Dramatiq's ``enqueue`` (and the dispatch
head every broker command starts with), the doorbell a write rings, ``move`` (a due delayed
message to its queue), ``guarded_enqueue`` and ``guarded_enqueue_batch``, and what every enqueue
step shares (the message is written before its guard). Rows and helpers:
:mod:`tests.integration.lua.tables`."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from kumiko_dramatiq.broker.replies import text
from tests.integration.lua.tables import (
    BELL,
    BELL_TTL,
    BOOT_MARKER,
    DEAD_TTL,
    DEDUP_INDEX,
    DQ,
    DQ_BELL,
    DQ_LIST,
    DQ_MSGS,
    ENDING,
    GUARD,
    GUARD_2,
    GUARD_3,
    HEARTBEAT_TIMEOUT,
    LAST_TICK,
    LIST,
    MSGS,
    NAMESPACE,
    NO_TTL,
    NOW,
    QUEUE,
    RECORD,
    SCHEDULE,
    SENT,
    SHORT_TTL,
    TICK,
    TTL,
    DueIn,
    Env,
    State,
    Z,
    message,
)


# The dispatch head: every broker command starts by parsing ARGV[2]; a head it cannot read
# is an error before anything is written (not even the heartbeat).
@pytest.mark.parametrize(
    "packed",
    [
        pytest.param(f"{NOW} w {HEARTBEAT_TIMEOUT} {DEAD_TTL}", id="a-field-missing"),
        pytest.param(f"{NOW} w {HEARTBEAT_TIMEOUT} {DEAD_TTL} 2", id="maintenance-not-0-or-1"),
        pytest.param(f"-{NOW} w {HEARTBEAT_TIMEOUT} {DEAD_TTL} 0", id="negative-now"),
        pytest.param(str(NOW), id="the-old-unpacked-head"),
    ],
)
def test_a_malformed_dispatch_head_is_refused(env: Env, packed: str) -> None:
    with pytest.raises(redis.ResponseError, match="malformed dispatch head"):
        env.lua.enqueue(keys=[NAMESPACE], args=[env.key(QUEUE), packed, "r1", "body"])

    env.assert_state({})


# Dramatiq's own enqueue command: no marker (kumiko's idempotent enqueue of a new message is
# guarded_enqueue behind its "sent" marker, see test_guarded_enqueue). It rings the queue's
# doorbell, as every write of a message does (enqueue_message in lua/_enqueue.lua).
@pytest.mark.parametrize(
    ("given", "queue", "after"),
    [
        pytest.param(
            {},
            QUEUE,
            {LIST: ["r1"], MSGS: {"r1": "body"}, BELL: ["1"]},
            id="writes-hash-and-list-and-rings",
        ),
        pytest.param(
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            QUEUE,
            {LIST: ["r0", "r1"], MSGS: {"r0": "b0", "r1": "body"}, BELL: ["1"]},
            id="appends-to-the-tail",
        ),
        pytest.param(
            {},
            DQ,
            {DQ_LIST: ["r1"], DQ_MSGS: {"r1": "body"}, DQ_BELL: ["1"]},
            id="delay-queue-rings-its-own-bell",
        ),
    ],
)
def test_enqueue(env: Env, given: State, queue: str, after: State) -> None:
    env.seed(given)

    assert env.lua.enqueue(keys=[NAMESPACE], args=[*env.head(queue), "r1", "body"]) == 1

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


# The doorbell (lua/_bell.lua, rung here by enqueue) holds one token at most, however many
# writes: a token is pushed, with its TTL, only when none waits; a waiting token is left as
# it is (its TTL not refreshed).
@pytest.mark.parametrize(
    ("waiting", "enqueues", "ttl"),
    [
        pytest.param(False, 1, BELL_TTL, id="an-enqueue-leaves-one-token-for-a-minute"),
        pytest.param(False, 3, BELL_TTL, id="many-enqueues-leave-one-token"),
        pytest.param(True, 2, SHORT_TTL, id="a-waiting-token-gets-no-second-and-keeps-its-ttl"),
    ],
)
def test_the_bell_holds_one_token_at_most(env: Env, waiting: bool, enqueues: int, ttl: int) -> None:
    # Given: a token left SHORT_TTL to live waits, or none does
    if waiting:
        env.seed({BELL: ["1"]})
        env.expire(BELL, SHORT_TTL)
    rids = [f"r{n}" for n in range(1, enqueues + 1)]

    for rid in rids:
        assert env.lua.enqueue(keys=[NAMESPACE], args=[*env.head(), rid, "body"]) == 1

    env.assert_state({LIST: rids, MSGS: dict.fromkeys(rids, "body"), BELL: ["1"]})
    env.assert_ttls({BELL: ttl})


def test_a_taken_token_is_rung_again_by_the_next_enqueue(env: Env) -> None:
    # Given: r1 was enqueued and an idle consumer took the token (its BLPOP)
    assert env.lua.enqueue(keys=[NAMESPACE], args=[*env.head(), "r1", "body"]) == 1
    assert env.client.lpop(env.key(BELL)) == b"1"
    env.assert_state({LIST: ["r1"], MSGS: {"r1": "body"}})

    # When: r2 is enqueued
    assert env.lua.enqueue(keys=[NAMESPACE], args=[*env.head(), "r2", "body"]) == 1

    # Then: a new token waits, for a minute again
    env.assert_state({LIST: ["r1", "r2"], MSGS: {"r1": "body", "r2": "body"}, BELL: ["1"]})
    env.assert_ttls({BELL: BELL_TTL})


@pytest.mark.parametrize(
    ("held", "rings"),
    [
        pytest.param(15, True, id="the-16th-message-rings"),
        pytest.param(16, False, id="the-17th-message-rings-nothing-a-backlog"),
    ],
)
def test_a_backlog_s_enqueues_ring_nothing(env: Env, held: int, rings: bool) -> None:
    # Given: the queue holds `held` messages and its token was taken (an idle consumer woke)
    rids = [f"r{n}" for n in range(1, held + 1)]
    env.seed({LIST: rids, MSGS: dict.fromkeys(rids, "body")})

    # When: one more is enqueued
    assert env.lua.enqueue(keys=[NAMESPACE], args=[*env.head(), "new", "body"]) == 1

    # Then: a token waits only while the queue holds at most 16 (include/enqueue.lua)
    state: State = {LIST: [*rids, "new"], MSGS: dict.fromkeys([*rids, "new"], "body")}
    env.assert_state({**state, BELL: ["1"]} if rings else state)


# A delayed message (handed over as "<delay ms> <body>", the body in the form it takes on its
# queue) goes on its queue's schedule at Redis's clock plus the delay, its body in the delay
# queue's hash; the delay queue's doorbell rings only when it is the earliest (a mover
# sleeping until a later due time must wake), never for a later one.
@pytest.mark.parametrize(
    ("given", "after"),
    [
        pytest.param(
            {},
            {
                DQ_MSGS: {"r1": "moved"},
                SCHEDULE: Z({"r1": DueIn(5_000)}),
                SENT: "1",
                DQ_BELL: ["1"],
            },
            id="the-earliest-rings-the-delay-queues-bell",
        ),
        pytest.param(
            {DQ_MSGS: {"r0": "b0"}, SCHEDULE: Z({"r0": 1})},
            {
                DQ_MSGS: {"r0": "b0", "r1": "moved"},
                SCHEDULE: Z({"r0": 1, "r1": DueIn(5_000)}),
                SENT: "1",
            },
            id="a-later-one-rings-nothing",
        ),
    ],
)
def test_a_delayed_enqueue_goes_on_the_schedule(env: Env, given: State, after: State) -> None:
    env.seed(given)

    reply = env.lua.guarded_enqueue(
        keys=[env.key(DQ_MSGS), env.key(DQ_LIST), env.key(SENT)],
        args=["r1", "5000 moved", TTL, "1"],
    )

    assert reply == [1]
    env.assert_state(after)


FAR = 9_000_000_000_000
MOVE_GIVEN: State = {
    LIST: ["r0"],
    MSGS: {"r0": "b0"},
    DQ_MSGS: {"d1": "b1", "d2": "b2", "d3": "b3"},
    SCHEDULE: Z({"d1": 1, "d2": 2, "d3": FAR}),
}


# move: the due ids (by Redis's clock), earliest first and at most the batch, leave the
# schedule for the queue's tail, their bodies the delay queue's hash for the queue's; the
# queue's bell rings; it answers how many moved, the next due time, Redis's clock and the
# length of Dramatiq's own delay queue list (work for schedule_legacy).
@pytest.mark.parametrize(
    ("given", "limit", "moved", "next_due", "after"),
    [
        pytest.param(
            MOVE_GIVEN,
            10,
            2,
            FAR,
            {
                LIST: ["r0", "d1", "d2"],
                MSGS: {"r0": "b0", "d1": "b1", "d2": "b2"},
                DQ_MSGS: {"d3": "b3"},
                SCHEDULE: Z({"d3": FAR}),
                BELL: ["1"],
            },
            id="due-ones-move-to-the-queues-tail-and-ring",
        ),
        pytest.param(
            MOVE_GIVEN,
            1,
            1,
            2,
            {
                LIST: ["r0", "d1"],
                MSGS: {"r0": "b0", "d1": "b1"},
                DQ_MSGS: {"d2": "b2", "d3": "b3"},
                SCHEDULE: Z({"d2": 2, "d3": FAR}),
                BELL: ["1"],
            },
            id="at-most-the-batch-earliest-first",
        ),
        pytest.param(
            {**MOVE_GIVEN, DQ_MSGS: {"d2": "b2", "d3": "b3"}},
            10,
            1,
            FAR,
            {
                LIST: ["r0", "d2"],
                MSGS: {"r0": "b0", "d2": "b2"},
                DQ_MSGS: {"d3": "b3"},
                SCHEDULE: Z({"d3": FAR}),
                BELL: ["1"],
            },
            id="an-id-without-a-body-is-dropped",
        ),
        pytest.param(
            {DQ_MSGS: {"d3": "b3"}, SCHEDULE: Z({"d3": FAR})},
            10,
            0,
            FAR,
            {DQ_MSGS: {"d3": "b3"}, SCHEDULE: Z({"d3": FAR})},
            id="nothing-due-changes-nothing",
        ),
        pytest.param({}, 10, 0, -1, {}, id="an-empty-schedule-has-no-next-due-time"),
    ],
)
def test_move(env: Env, given: State, limit: int, moved: int, next_due: int, after: State) -> None:
    env.seed(given)

    reply = env.lua.move(keys=[NAMESPACE], args=[*env.head(DQ), limit])

    assert reply[:2] == [moved, next_due]
    assert DueIn(0) == reply[2]
    assert reply[3] == 0
    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


def test_move_reports_dramatiqs_own_delay_queue_list(env: Env) -> None:
    env.seed({DQ_LIST: ["d1", "d2"], DQ_MSGS: {"d1": "old1", "d2": "old2"}})

    reply = env.lua.move(keys=[NAMESPACE], args=[*env.head(DQ), 10])

    assert reply[:2] == [0, -1]
    assert reply[3] == 2
    env.assert_state({DQ_LIST: ["d1", "d2"], DQ_MSGS: {"d1": "old1", "d2": "old2"}})


# schedule_legacy: each id still on Dramatiq's delay queue list leaves it for the schedule at
# its due time, its body replaced by the form given; a cancelled one (no body) is dropped; one
# no longer listed (an old worker fetched it) is left alone.
def test_schedule_legacy_moves_listed_ids_onto_the_schedule(env: Env) -> None:
    env.seed({DQ_LIST: ["d1", "d2", "d3"], DQ_MSGS: {"d1": "old1", "d3": "old3", "d4": "old4"}})

    reply = env.lua.schedule_legacy(
        keys=[NAMESPACE],
        args=[*env.head(DQ), "d1", 123, "new1", "d2", 5, "", "d4", 7, "new4"],
    )

    assert reply == 2  # d1 scheduled, d2 dropped
    env.assert_state(
        {
            DQ_LIST: ["d3"],
            DQ_MSGS: {"d1": "new1", "d3": "old3", "d4": "old4"},
            SCHEDULE: Z({"d1": 123}),
            DQ_BELL: ["1"],
        }
    )


# move_now: the first candidate on its queue's schedule moves now, whatever its due time.
@pytest.mark.parametrize(
    ("given", "reply", "after"),
    [
        pytest.param(
            {DQ_MSGS: {"d3": "b3"}, SCHEDULE: Z({"d3": FAR})},
            [1, "{q}", "d3"],
            {LIST: ["d3"], MSGS: {"d3": "b3"}, BELL: ["1"]},
            id="a-scheduled-one-moves",
        ),
        pytest.param(
            {LIST: ["d3"], MSGS: {"d3": "b3"}},
            [0],
            {LIST: ["d3"], MSGS: {"d3": "b3"}},
            id="a-queued-one-is-not-delayed",
        ),
    ],
)
def test_move_now(env: Env, given: State, reply: list[Any], after: State) -> None:
    env.seed(given)

    result = env.lua.move_now(keys=[NAMESPACE], args=[env.key(QUEUE), "dx", env.key(QUEUE), "d3"])

    assert result[0] == reply[0]
    assert [text(item) for item in result[1:]] == [env.key(item) for item in reply[1:]]
    env.assert_state(after)


# Like every enqueue step below, a message written rings its queue's doorbell; one guarded
# out writes nothing, the bell included.
@pytest.mark.parametrize(
    ("given", "reply", "after", "ttls"),
    [
        pytest.param(
            {},
            [1],
            {LIST: ["r1"], MSGS: {"r1": "body"}, GUARD: "sched-1", BELL: ["1"]},
            {GUARD: TTL, BELL: BELL_TTL},
            id="guard-absent-enqueues-and-rings",
        ),
        pytest.param(
            {GUARD: "sched-0"},
            [0],
            {GUARD: "sched-0"},
            {GUARD: NO_TTL},
            id="guard-present-writes-nothing",
        ),
    ],
)
def test_guarded_enqueue(
    env: Env, given: State, reply: list[int], after: State, ttls: dict[str, int]
) -> None:
    env.seed(given)

    result = env.lua.guarded_enqueue(
        keys=[env.key(MSGS), env.key(LIST), env.key(GUARD)], args=["r1", "body", TTL, "sched-1"]
    )

    assert result == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


def test_guarded_enqueue_behind_a_sent_marker_is_written_once(env: Env) -> None:
    # Given: the call KumikoBroker.enqueue makes: the guard is the "sent" marker of the rid
    keys = [env.key(MSGS), env.key(LIST), env.key(SENT)]
    args: list[str | int] = ["r1", "body", TTL, "1"]

    # When: the same write is sent twice (a command re-sent after a dropped connection)
    first = env.lua.guarded_enqueue(keys=keys, args=args)
    second = env.lua.guarded_enqueue(keys=keys, args=args)

    # Then: the message is there once, and the marker keeps its first TTL
    assert (first, second) == ([1], [0])
    env.assert_state({LIST: ["r1"], MSGS: {"r1": "body"}, SENT: "1", BELL: ["1"]})
    env.assert_ttls({SENT: TTL, BELL: BELL_TTL})


# guarded_enqueue with guard TTL 0 (KumikoBroker.enqueue on a lane queue): the "sent" key is
# only read. The message is written unless its body is there (a re-sent command while the
# first copy waits or runs) or the key holds the tombstone a body's end left (retry, dead
# letter, plain ack, cancel); nothing of its own is set but the doorbell.
@pytest.mark.parametrize(
    ("given", "reply", "after"),
    [
        pytest.param(
            {},
            [1],
            {LIST: ["r1"], MSGS: {"r1": "body"}, BELL: ["1"]},
            id="new-written-no-key-set",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": "first"}},
            [0],
            {LIST: ["r1"], MSGS: {"r1": "first"}},
            id="body-there-a-resend-writes-nothing",
        ),
        pytest.param(
            {SENT: "1"},
            [0],
            {SENT: "1"},
            id="tombstone-a-resend-after-its-end-writes-nothing",
        ),
    ],
)
def test_guarded_enqueue_on_a_lane_only_reads_its_sent_key(
    env: Env, given: State, reply: list[int], after: State
) -> None:
    env.seed(given)

    result = env.lua.guarded_enqueue(
        keys=[env.key(MSGS), env.key(LIST), env.key(SENT)], args=["r1", "body", 0, "1"]
    )

    assert result == reply
    env.assert_state(after)


def test_guarded_enqueue_refuses_ttl_0_on_a_delay_queue(env: Env) -> None:
    # A delayed body leaves its hash when it moves to its queue: it keeps its marker, so a
    # TTL of 0 there is refused before anything is written.
    with pytest.raises(redis.ResponseError, match="guard TTL must be an integer"):
        env.lua.guarded_enqueue(
            keys=[env.key(DQ_MSGS), env.key(DQ_LIST), env.key(SENT)],
            args=["r1", "5000 moved", 0, "1"],
        )
    env.assert_state({})


@pytest.mark.parametrize(
    ("given", "triples", "reply", "after", "ttls"),
    [
        pytest.param(
            {GUARD_2: "sched-0"},
            [(GUARD, "r1", "b1"), (GUARD_2, "r2", "b2"), (GUARD_3, "r3", "b3")],
            [1, 0, 1],
            {
                LIST: ["r1", "r3"],
                MSGS: {"r1": "b1", "r3": "b3"},
                GUARD: "sched-1",
                GUARD_2: "sched-0",
                GUARD_3: "sched-1",
                BELL: ["1"],
            },
            {GUARD: TTL, GUARD_2: NO_TTL, GUARD_3: TTL, BELL: BELL_TTL},
            id="mixed-guards-two-written-one-token",
        ),
        pytest.param(
            {},
            [(GUARD, "r1", "b1"), (GUARD, "r2", "b2")],
            [1, 0],
            {LIST: ["r1"], MSGS: {"r1": "b1"}, GUARD: "sched-1", BELL: ["1"]},
            {GUARD: TTL, BELL: BELL_TTL},
            id="same-guard-twice-in-one-batch",
        ),
        pytest.param(
            {GUARD: "sched-0"},
            [(GUARD, "r1", "b1")],
            [0],
            {GUARD: "sched-0"},
            {GUARD: NO_TTL},
            id="all-guarded-no-ring",
        ),
        pytest.param({}, [], [], {}, {}, id="empty-batch"),
    ],
)
def test_guarded_enqueue_batch(
    env: Env,
    given: State,
    triples: list[tuple[str, str, str]],
    reply: list[int],
    after: State,
    ttls: dict[str, int],
) -> None:
    env.seed(given)
    args: list[Any] = [TTL, "sched-1"]
    for guard, rid, body in triples:
        args += [env.key(guard), rid, body]

    result = env.lua.guarded_enqueue_batch(keys=[env.key(MSGS), env.key(LIST)], args=args)

    assert result == reply
    env.assert_state(after)
    env.assert_ttls(ttls)


# Enqueue steps write the message before its guard. Lua does not roll back: a message that
# fails to write (here: its hash key holds a string) must leave no guard, marker or record
# behind that would block it for good.
@pytest.mark.parametrize(
    "script",
    ["guarded_enqueue", "guarded_enqueue_batch", "boot_once", "cron_tick", "dedup_handover"],
)
def test_a_failed_message_write_leaves_no_guard(env: Env, script: str) -> None:
    # Given: the queue's message hash key holds a string
    env.seed({MSGS: "not a hash"})
    if script == "dedup_handover":
        env.seed({RECORD: ENDING})
    queue_keys = [env.key(MSGS), env.key(LIST)]
    calls: dict[str, tuple[list[str], list[str | int]]] = {
        "guarded_enqueue": ([*queue_keys, env.key(GUARD)], ["r1", "body", TTL, "sched-1"]),
        "guarded_enqueue_batch": (queue_keys, [TTL, "sched-1", env.key(GUARD), "r1", "body"]),
        "boot_once": (
            [*queue_keys, env.key(BOOT_MARKER), env.key(GUARD)],
            ["r1", "body", TTL, "m1"],
        ),
        "cron_tick": (
            [
                *queue_keys,
                env.key(GUARD),
                env.key(LAST_TICK),
                env.key("kumiko:{p}:schedules:paused"),
                env.key("kumiko:{p}:dedup:app.job:schedule:app.job"),
                env.key("kumiko:{p}:dedupidx:app.job"),
                env.key("kumiko:{p}:cron-skipped"),
            ],
            ["r1", "body", TTL, "sched-1", TICK, TTL, "app.job", "allow", "m1", "{}"],
        ),
        "dedup_handover": (
            [*queue_keys, env.key(RECORD), env.key(DEDUP_INDEX)],
            ["r5", "follow-up", "m1", "m5", TTL, "k1"],
        ),
    }
    keys, args = calls[script]

    # When / Then: the script errors out, and nothing besides the seeded keys exists
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        getattr(env.lua, script)(keys=keys, args=args)
    expected: State = {MSGS: "not a hash"}
    if script == "dedup_handover":
        expected[RECORD] = ENDING
    env.assert_state(expected)


def test_each_call_reads_the_counts_mode_afresh(env: Env) -> None:
    # guarded_enqueue runs as a function of the hot path's library, whose variables outlive
    # a call: what one call keeps (the counts mode it read) must not reach the next
    counts = env.key(MSGS).removesuffix(".msgs") + ":counts"
    keys = [env.key(MSGS), env.key(LIST)]

    # Given: a message written while the queue was not counted (it held an older body, so
    # its counts did not start at this one: include/counts.lua, counts_start)
    env.client.hset(env.key(MSGS), "r0", message("m0"))
    env.lua.guarded_enqueue(keys=[*keys, env.key(SENT)], args=["r1", message("m1"), TTL, "1"])
    assert not env.client.exists(counts)
    # When: the counts are made ready, and another message is written
    env.client.hset(counts, "~mode", "r")
    env.lua.guarded_enqueue(keys=[*keys, env.key(SENT) + "2"], args=["r2", message("m2"), TTL, "1"])
    # Then: the second is counted
    assert env.client.hgetall(counts) == {b"~mode": b"r", b"q:a": b"1"}
