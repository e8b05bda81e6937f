"""State tables of the scripts that claim and unclaim messages: Dramatiq's ``fetch`` and the
maintenance a broker command runs (a dead worker's messages back to their queue),
``fetch_lane`` (claims, suspects run alone, poison messages dead-lettered, paused jobs, its
run records), ``requeue`` (a claim undone), and the in-flight hash across them. Rows and
helpers: :mod:`tests.integration.lua.tables`."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.lua.tables import (
    ACKS,
    ACKS_W2,
    ALIVE_AT,
    BELL,
    BELL_TTL,
    CLAIMED_AT,
    DEAD_ACKS,
    DEAD_ACKS_OTHER,
    DEAD_AT,
    DEAD_DQ_ACKS,
    DEAD_TTL,
    DONE_M1,
    DONE_PREFIX,
    DQ,
    DQ_BELL,
    DQ_LIST,
    DQ_MSGS,
    ENQUEUED_AT,
    FAILED_TTL,
    HEARTBEAT_TIMEOUT,
    HEARTBEATS,
    INDEX_TTL,
    INFLIGHT,
    JOB,
    LIST,
    MAX_DELIVERIES,
    MSGS,
    NAMESPACE,
    NOW,
    PARKED,
    PARKED_WITHDRAWN,
    PAUSED_JOB,
    QUEUE,
    ROOT,
    SUSPECTS,
    TENANT_JOB,
    TICK_AT,
    WITHDRAWN,
    XQ,
    XQ_MSGS,
    Env,
    State,
    Z,
    by_origin,
    by_tenant,
    dead_note,
    died,
    died_note,
    earlier,
    encoded,
    ended,
    entry,
    header_of,
    indexed,
    kumiko_message,
    message,
    run_hash,
    text,
)


# Dramatiq's own fetch: pops and claims, checks nothing (kumiko's lane queues use
# fetch_lane). Its reply is flat: rid, body, rid, body, ... A full batch (N) that leaves
# messages on the queue rings its doorbell for the next idle consumer; a fetch that takes
# fewer than N, or empties the queue, does not.
@pytest.mark.parametrize(
    ("given", "count", "reply", "after"),
    [
        pytest.param({}, 3, [], {}, id="empty-queue"),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r1": "b1", "r2": "b2"}},
            3,
            ["r1", "b1", "r2", "b2"],
            {MSGS: {"r1": "b1", "r2": "b2"}, ACKS: {"r1", "r2"}},
            id="fewer-than-n-does-not-ring",
        ),
        pytest.param(
            {LIST: ["r1", "r2", "r3"], MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"}},
            2,
            ["r1", "b1", "r2", "b2"],
            {
                LIST: ["r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                ACKS: {"r1", "r2"},
                BELL: ["1"],
            },
            id="exactly-n-leftover-stays-and-rings",
        ),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r1": "b1", "r2": "b2"}},
            2,
            ["r1", "b1", "r2", "b2"],
            {MSGS: {"r1": "b1", "r2": "b2"}, ACKS: {"r1", "r2"}},
            id="exactly-n-emptying-the-queue-does-not-ring",
        ),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r2": "b2"}},
            2,
            ["r1", None, "r2", "b2"],
            {MSGS: {"r2": "b2"}, ACKS: {"r1", "r2"}},
            id="vanished-body-is-none-and-still-claimed",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": "b1"}},
            0,
            [],
            {LIST: ["r1"], MSGS: {"r1": "b1"}, BELL: ["1"]},
            id="zero-fetches-nothing-a-full-batch-of-0-with-messages-left-rings",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": "b1"}},
            1,
            ["r1", "b1"],
            {MSGS: {"r1": "b1"}, ACKS: {"r1"}},
            id="no-in-flight-entry-for-dramatiqs-own-queues",
        ),
    ],
)
def test_fetch(env: Env, given: State, count: int, reply: list[Any], after: State) -> None:
    env.seed(given)

    result = env.lua.fetch(keys=[NAMESPACE], args=[*env.head(), count])

    assert text(result) == reply
    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


def test_fetch_maintenance_recovers_a_dead_workers_messages(env: Env) -> None:
    # Given: w0's heartbeat is older than the timeout; it claimed r1 (body) and r2 (no body)
    env.client.zadd(HEARTBEATS, {env.names["w0"]: DEAD_AT})
    env.seed({LIST: ["r0"], MSGS: {"r0": "b0", "r1": "b1"}, DEAD_ACKS: {"r1", "r2"}})

    # When: w1 fetches one message with maintenance
    result = env.lua.fetch(keys=[NAMESPACE], args=[*env.head(maintenance=True), 1])

    # Then: r1 went back to the tail (r0 was fetched first) and the bell rang, r2 is
    # forgotten, the ack set is gone and w0, with no ack set left anywhere, left the heartbeats
    assert text(result) == ["r0", "b0"]
    env.assert_state({LIST: ["r1"], MSGS: {"r0": "b0", "r1": "b1"}, ACKS: {"r0"}, BELL: ["1"]})
    assert env.heartbeat("w0") is None
    assert env.heartbeat("w1") == NOW


def test_fetch_maintenance_keeps_a_dead_worker_with_another_queues_ack_set(env: Env) -> None:
    env.client.zadd(HEARTBEATS, {env.names["w0"]: DEAD_AT})
    env.seed({MSGS: {"r1": "b1"}, DEAD_ACKS: {"r1"}, DEAD_ACKS_OTHER: {"x1"}})

    result = env.lua.fetch(keys=[NAMESPACE], args=[*env.head(maintenance=True), 0])

    # Then: this queue's claims are recovered; the other queue's ack set (and w0) stay
    assert text(result) == []
    env.assert_state({LIST: ["r1"], MSGS: {"r1": "b1"}, DEAD_ACKS_OTHER: {"x1"}, BELL: ["1"]})
    assert env.heartbeat("w0") == DEAD_AT


def long_with_decoy(message_id: str, decoy: str) -> str:
    """An encoded message longer than the 160 bytes fetch_lane looks at first, whose payload
    holds a "message_id" field of its own (a decoy) before the real one."""
    return encoded(
        {
            "queue_name": "q",
            "actor_name": "a",
            "args": [{"message_id": decoy, "pad": "x" * 200}],
            "kwargs": {},
            "options": {},
            "message_id": message_id,
            "message_timestamp": ENQUEUED_AT,
        }
    )


@pytest.mark.parametrize(
    ("heartbeat", "maintenance"),
    [
        pytest.param(ALIVE_AT, True, id="live-worker"),
        pytest.param(DEAD_AT, False, id="dead-worker-without-maintenance"),
    ],
)
def test_fetch_leaves_claims_alone(env: Env, heartbeat: int, maintenance: bool) -> None:
    env.client.zadd(HEARTBEATS, {env.names["w0"]: heartbeat})
    env.seed({MSGS: {"r1": "b1"}, DEAD_ACKS: {"r1"}})

    env.lua.fetch(keys=[NAMESPACE], args=[*env.head(maintenance=maintenance), 0])

    env.assert_state({MSGS: {"r1": "b1"}, DEAD_ACKS: {"r1"}})
    assert env.heartbeat("w0") == heartbeat


# Maintenance rings the queue's doorbell iff a dead worker's message went back (once, however
# many did). These rows run it through ack (of an id nobody holds), which rings nothing of
# its own, unlike fetch. Dead workers are recovered oldest heartbeat first.
@pytest.mark.parametrize(
    ("heartbeats", "queue", "given", "after"),
    [
        pytest.param(
            {"w0": DEAD_AT, "w2": DEAD_AT + 1},
            QUEUE,
            {MSGS: {"r1": "b1", "r2": "b2"}, DEAD_ACKS: {"r1"}, ACKS_W2: {"r2"}},
            {LIST: ["r1", "r2"], MSGS: {"r1": "b1", "r2": "b2"}, BELL: ["1"]},
            id="two-dead-workers-messages-went-back-one-token",
        ),
        pytest.param(
            {"w0": DEAD_AT},
            DQ,
            {DQ_MSGS: {"d1": "bd"}, DEAD_DQ_ACKS: {"d1"}},
            {DQ_LIST: ["d1"], DQ_MSGS: {"d1": "bd"}, DQ_BELL: ["1"]},
            id="a-delay-queues-message-went-back-its-bell-rings",
        ),
        pytest.param(
            {"w0": DEAD_AT},
            QUEUE,
            {DEAD_ACKS: {"r1", "r2"}},
            {},
            id="only-bodyless-claims-nothing-went-back-no-ring",
        ),
        pytest.param(
            {"w0": ALIVE_AT},
            QUEUE,
            {MSGS: {"r1": "b1"}, DEAD_ACKS: {"r1"}},
            {MSGS: {"r1": "b1"}, DEAD_ACKS: {"r1"}},
            id="a-live-workers-claims-stay-no-ring",
        ),
    ],
)
def test_maintenance_rings_only_when_a_message_went_back(
    env: Env, heartbeats: dict[str, int], queue: str, given: State, after: State
) -> None:
    env.client.zadd(HEARTBEATS, {env.names[worker]: at for worker, at in heartbeats.items()})
    env.seed(given)

    assert env.lua.ack(keys=[NAMESPACE], args=[*env.head(queue, maintenance=True), "r9"]) == 0

    env.assert_state(after)
    env.assert_ttls({key: BELL_TTL for key in after if key.endswith(":bell")})


@pytest.mark.parametrize(
    ("queue", "maintenance", "after"),
    [
        pytest.param(
            QUEUE,
            True,
            {XQ: Z({"young": NOW - 1_000}), XQ_MSGS: {"young": "by"}},
            id="expired-deleted-young-kept",
        ),
        pytest.param(
            DQ,
            True,
            {XQ: Z({"young": NOW - 1_000}), XQ_MSGS: {"young": "by"}},
            id="delay-queue-expires-the-canonical-dead-letters",
        ),
        pytest.param(
            QUEUE,
            False,
            {
                XQ: Z({"old": NOW - DEAD_TTL - 1_000, "young": NOW - 1_000}),
                XQ_MSGS: {"old": "bo", "young": "by"},
            },
            id="nothing-expires-without-maintenance",
        ),
    ],
)
def test_fetch_maintenance_expires_dead_letters(
    env: Env, queue: str, maintenance: bool, after: State
) -> None:
    env.seed(
        {
            XQ: Z({"old": NOW - DEAD_TTL - 1_000, "young": NOW - 1_000}),
            XQ_MSGS: {"old": "bo", "young": "by"},
        }
    )

    env.lua.fetch(keys=[NAMESPACE], args=[*env.head(queue, maintenance=maintenance), 1])

    env.assert_state(after)


# Reply: [{rid, body, ...} claimed, {message ids acked as already completed},
# {rid, deliveries, ...} dead-lettered, suspects waiting, 1 if a suspect was claimed alone].
# Each claim joins the ack set and puts "<deliveries + 1>|<now>|<host:pid>" in the in-flight
# hash; no run record is written (running runs are read off that hash). A "suspect" is an id
# with an in-flight entry already (its worker died while holding it); "held" is the messages
# the consumer holds (0 = idle). A paused job's message is parked, not claimed. The queue's
# doorbell rings when a full batch (N) left messages on the queue, or when a consumer that
# holds messages leaves a suspect waiting. These rows use messages that are not kumiko's (no
# run record): see test_fetch_lane_run_history.


@pytest.mark.parametrize(
    ("given", "count", "done_prefix", "held", "reply", "after"),
    [
        pytest.param({}, 3, "", 0, [[], [], [], 0, 0], {}, id="empty-queue"),
        # -- plain claims
        pytest.param(
            {
                LIST: ["r1", "r2", "r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                INFLIGHT: {"r9": earlier(1)},
            },
            2,
            "",
            0,
            [["r1", "b1", "r2", "b2"], [], [], 0, 0],
            {
                LIST: ["r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                ACKS: {"r1", "r2"},
                INFLIGHT: {"r1": entry(1), "r2": entry(1), "r9": earlier(1)},
                BELL: ["1"],
            },
            id="claims-n-each-gets-an-in-flight-entry-leftover-stays-and-rings",
        ),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r1": "b1", "r2": "b2"}},
            2,
            "",
            0,
            [["r1", "b1", "r2", "b2"], [], [], 0, 0],
            {
                MSGS: {"r1": "b1", "r2": "b2"},
                ACKS: {"r1", "r2"},
                INFLIGHT: {"r1": entry(1), "r2": entry(1)},
            },
            id="claims-n-emptying-the-queue-does-not-ring",
        ),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r1": "b1", "r2": "b2"}},
            1,
            "",
            2,
            [["r1", "b1"], [], [], 0, 0],
            {
                LIST: ["r2"],
                MSGS: {"r1": "b1", "r2": "b2"},
                ACKS: {"r1"},
                INFLIGHT: {"r1": entry(1)},
                BELL: ["1"],
            },
            id="n-counts-messages-not-reply-entries",
        ),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r2": "b2"}},
            3,
            "",
            0,
            [["r1", None, "r2", "b2"], [], [], 0, 0],
            {MSGS: {"r2": "b2"}, ACKS: {"r1", "r2"}, INFLIGHT: {"r1": entry(1), "r2": entry(1)}},
            id="fewer-than-n-vanished-body-is-none-and-still-claimed-no-ring",
        ),
        # -- "already completed" markers
        pytest.param(
            {
                LIST: ["r1", "r2", "r3"],
                MSGS: {"r1": message("m1"), "r2": message("m2"), "r3": message("m3")},
                DONE_M1: "1",
            },
            2,
            DONE_PREFIX,
            0,
            [["r2", message("m2"), "r3", message("m3")], ["m1"], [], 0, 0],
            {
                MSGS: {"r2": message("m2"), "r3": message("m3")},
                ACKS: {"r2", "r3"},
                INFLIGHT: {"r2": entry(1), "r3": entry(1)},
                DONE_M1: "1",
            },
            id="completed-message-is-acked-and-listed-not-counted-in-n",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": message("m1")}, DONE_M1: "1"},
            1,
            "",
            0,
            [["r1", message("m1")], [], [], 0, 0],
            {
                MSGS: {"r1": message("m1")},
                ACKS: {"r1"},
                INFLIGHT: {"r1": entry(1)},
                DONE_M1: "1",
            },
            id="completed-marker-ignored-without-prefix",
        ),
        pytest.param(
            {LIST: ["r1"], DONE_M1: "1"},
            1,
            DONE_PREFIX,
            0,
            [["r1", None], [], [], 0, 0],
            {ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}, DONE_M1: "1"},
            id="vanished-body-with-prefix-is-still-returned",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": "not json {"}},
            1,
            DONE_PREFIX,
            0,
            [["r1", "not json {"], [], [], 0, 0],
            {MSGS: {"r1": "not json {"}, ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}},
            id="non-json-body-is-returned-not-dropped",
        ),
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r1": "[1, 2]", "r2": '{"message_id": 7}'}},
            2,
            DONE_PREFIX,
            0,
            [["r1", "[1, 2]", "r2", '{"message_id": 7}'], [], [], 0, 0],
            {
                MSGS: {"r1": "[1, 2]", "r2": '{"message_id": 7}'},
                ACKS: {"r1", "r2"},
                INFLIGHT: {"r1": entry(1), "r2": entry(1)},
            },
            id="json-without-a-string-message-id-is-returned",
        ),
        pytest.param(
            {
                LIST: ["r1", "r2"],
                MSGS: {"r1": long_with_decoy("m1", "m2"), "r2": long_with_decoy("m2", "m1")},
                DONE_M1: "1",
            },
            2,
            DONE_PREFIX,
            0,
            [["r2", long_with_decoy("m2", "m1")], ["m1"], [], 0, 0],
            {
                MSGS: {"r2": long_with_decoy("m2", "m1")},
                ACKS: {"r2"},
                INFLIGHT: {"r2": entry(1)},
                DONE_M1: "1",
            },
            id="a-long-body-is-checked-by-its-own-message-id-not-one-in-its-payload",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": json.dumps({"message_id": "m1"})}, DONE_M1: "1"},
            1,
            DONE_PREFIX,
            0,
            [["r1", json.dumps({"message_id": "m1"})], [], [], 0, 0],
            {
                MSGS: {"r1": json.dumps({"message_id": "m1"})},
                ACKS: {"r1"},
                INFLIGHT: {"r1": entry(1)},
                DONE_M1: "1",
            },
            id="a-body-not-laid-out-as-dramatiq-encodes-is-not-checked-for-its-marker",
        ),
        # -- suspects while the consumer holds messages: set aside (the bell rings for an
        # idle consumer), healthy ones still come
        pytest.param(
            {
                LIST: ["r1", "r2", "r3", "r4"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3", "r4": "b4"},
                INFLIGHT: {"r1": earlier(1), "r3": earlier(2)},
            },
            2,
            "",
            1,
            [["r2", "b2", "r4", "b4"], [], [], 2, 0],
            {
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3", "r4": "b4"},
                ACKS: {"r2", "r4"},
                INFLIGHT: {"r1": earlier(1), "r2": entry(1), "r3": earlier(2), "r4": entry(1)},
                SUSPECTS: ["r1", "r3"],
                BELL: ["1"],
            },
            id="holding-suspects-go-to-the-suspects-list-loop-goes-on",
        ),
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": "b1"}, INFLIGHT: {"r1": earlier(1)}},
            2,
            "",
            1,
            [[], [], [], 1, 0],
            {MSGS: {"r1": "b1"}, INFLIGHT: {"r1": earlier(1)}, SUSPECTS: ["r1"], BELL: ["1"]},
            id="holding-a-suspect-left-waiting-rings-though-nothing-was-claimed",
        ),
        pytest.param(
            {
                LIST: ["r1"],
                MSGS: {"r1": "b1", "r2": "b2"},
                INFLIGHT: {"r2": earlier(MAX_DELIVERIES)},
                SUSPECTS: ["r2"],
            },
            2,
            "",
            1,
            [["r1", "b1"], [], [], 1, 0],
            {
                MSGS: {"r1": "b1", "r2": "b2"},
                ACKS: {"r1"},
                INFLIGHT: {"r1": entry(1), "r2": earlier(MAX_DELIVERIES)},
                SUSPECTS: ["r2"],
                BELL: ["1"],
            },
            id="holding-the-suspects-list-is-not-touched-a-waiting-suspect-rings",
        ),
        # -- idle (held = 0): one suspect runs alone, its deliveries counted on; messages it
        # leaves behind a suspect run alone ring the bell for other consumers
        pytest.param(
            {
                LIST: ["r1"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                INFLIGHT: {"r2": earlier(1), "r3": earlier(2)},
                SUSPECTS: ["r2", "r3"],
            },
            3,
            "",
            0,
            [["r2", "b2"], [], [], 1, 1],
            {
                LIST: ["r1"],
                BELL: ["1"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                ACKS: {"r2"},
                INFLIGHT: {"r2": entry(2), "r3": earlier(2)},
                SUSPECTS: ["r3"],
            },
            id="idle-first-suspect-of-the-list-claimed-alone-by-this-worker",
        ),
        pytest.param(
            {
                LIST: ["r2", "r1"],
                MSGS: {"r1": "b1", "r2": "b2"},
                INFLIGHT: {"r2": earlier(MAX_DELIVERIES - 1)},
            },
            3,
            "",
            0,
            [["r2", "b2"], [], [], 0, 1],
            {
                LIST: ["r1"],
                BELL: ["1"],
                MSGS: {"r1": "b1", "r2": "b2"},
                ACKS: {"r2"},
                INFLIGHT: {"r2": entry(MAX_DELIVERIES)},
            },
            id="idle-no-suspects-waiting-suspect-popped-first-claimed-alone",
        ),
        pytest.param(
            {
                LIST: ["r1", "r2", "r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                INFLIGHT: {"r2": earlier(1)},
            },
            3,
            "",
            0,
            [["r1", "b1", "r3", "b3"], [], [], 1, 0],
            {
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                ACKS: {"r1", "r3"},
                INFLIGHT: {"r1": entry(1), "r2": earlier(1), "r3": entry(1)},
                SUSPECTS: ["r2"],
            },
            id="idle-suspect-after-a-healthy-claim-is-set-aside",
        ),
        pytest.param(
            {
                LIST: ["r2"],
                MSGS: {"r1": message("m1"), "r2": message("m2"), "r3": message("m3")},
                INFLIGHT: {"r1": earlier(1), "r3": earlier(1)},
                SUSPECTS: ["r1", "r3"],
                DONE_M1: "1",
            },
            2,
            DONE_PREFIX,
            0,
            [["r3", message("m3")], ["m1"], [], 0, 1],
            {
                LIST: ["r2"],
                BELL: ["1"],
                MSGS: {"r2": message("m2"), "r3": message("m3")},
                ACKS: {"r3"},
                INFLIGHT: {"r3": entry(2)},
                DONE_M1: "1",
            },
            id="idle-completed-suspect-is-acked-its-entry-dropped-and-the-next-runs-alone",
        ),
        # -- poison messages: dead-lettered at the max deliveries, their entry dropped
        pytest.param(
            {
                LIST: ["r1", "r2"],
                MSGS: {"r1": "b1", "r2": "b2"},
                INFLIGHT: {"r1": earlier(MAX_DELIVERIES)},
            },
            2,
            "",
            0,
            [["r2", "b2"], [], ["r1", MAX_DELIVERIES], 0, 0],
            {
                MSGS: {"r2": "b2"},
                ACKS: {"r2"},
                INFLIGHT: {"r2": entry(1)},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
            },
            id="at-max-from-the-main-list-dead-lettered",
        ),
        pytest.param(
            {
                LIST: ["r1", "r2"],
                MSGS: {"r1": "b1", "r2": "b2"},
                INFLIGHT: {"r1": earlier(MAX_DELIVERIES + 2)},
            },
            2,
            "",
            1,
            [["r2", "b2"], [], ["r1", MAX_DELIVERIES + 2], 0, 0],
            {
                MSGS: {"r2": "b2"},
                ACKS: {"r2"},
                INFLIGHT: {"r2": entry(1)},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
            },
            id="above-max-while-holding-dead-lettered",
        ),
        pytest.param(
            {
                LIST: ["r3"],
                MSGS: {"r1": "b1", "r2": "b2", "r3": "b3"},
                INFLIGHT: {"r1": earlier(MAX_DELIVERIES), "r2": earlier(1)},
                SUSPECTS: ["r1", "r2"],
            },
            2,
            "",
            0,
            [["r2", "b2"], [], ["r1", MAX_DELIVERIES], 0, 1],
            {
                LIST: ["r3"],
                BELL: ["1"],
                MSGS: {"r2": "b2", "r3": "b3"},
                ACKS: {"r2"},
                INFLIGHT: {"r2": entry(2)},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
            },
            id="at-max-from-the-suspects-list-dead-lettered-next-runs-alone",
        ),
        pytest.param(
            {LIST: ["r1"], INFLIGHT: {"r1": earlier(MAX_DELIVERIES)}},
            1,
            "",
            0,
            [[], [], ["r1", MAX_DELIVERIES], 0, 0],
            {},
            id="at-max-with-a-vanished-body-entry-still-dropped",
        ),
        # -- paused jobs: their messages are parked (in order), never claimed or counted
        pytest.param(
            {
                **PAUSED_JOB,
                LIST: ["r1", "r2", "r3"],
                MSGS: {"r1": message("m1", JOB), "r2": message("m2"), "r3": message("m3", JOB)},
            },
            1,
            "",
            0,
            [["r2", message("m2")], [], [], 0, 0],
            {
                **PAUSED_JOB,
                PARKED: ["r1"],
                LIST: ["r3"],
                MSGS: {"r1": message("m1", JOB), "r2": message("m2"), "r3": message("m3", JOB)},
                ACKS: {"r2"},
                INFLIGHT: {"r2": entry(1)},
                BELL: ["1"],
            },
            id="paused-jobs-message-is-parked-not-claimed-not-counted-in-n",
        ),
        pytest.param(
            {
                **PAUSED_JOB,
                PARKED: ["r0"],
                LIST: ["r1"],
                MSGS: {"r0": message("m0", JOB), "r1": message("m1", f"{JOB}:fanout")},
            },
            1,
            "",
            0,
            [[], [], [], 0, 0],
            {
                **PAUSED_JOB,
                PARKED: ["r0", "r1"],
                MSGS: {"r0": message("m0", JOB), "r1": message("m1", f"{JOB}:fanout")},
            },
            id="paused-jobs-fan-out-wrapper-is-parked-behind-its-job",
        ),
        pytest.param(
            {
                **PAUSED_JOB,
                LIST: ["r2"],
                MSGS: {"r1": message("m1", JOB), "r2": message("m2")},
                INFLIGHT: {"r1": earlier(1)},
                SUSPECTS: ["r1"],
            },
            2,
            "",
            0,
            [["r2", message("m2")], [], [], 0, 0],
            {
                **PAUSED_JOB,
                PARKED: ["r1"],
                MSGS: {"r1": message("m1", JOB), "r2": message("m2")},
                ACKS: {"r2"},
                INFLIGHT: {"r1": earlier(1), "r2": entry(1)},
            },
            id="paused-suspect-is-parked-keeping-its-count-next-is-claimed-normally",
        ),
        pytest.param(
            {
                **PAUSED_JOB,
                LIST: ["r1"],
                MSGS: {"r1": message("m1", JOB)},
                INFLIGHT: {"r1": earlier(MAX_DELIVERIES)},
            },
            1,
            "",
            0,
            [[], [], ["r1", MAX_DELIVERIES], 0, 0],
            {**PAUSED_JOB, XQ: Z({"r1": NOW}), XQ_MSGS: {"r1": message("m1", JOB)}},
            id="paused-jobs-poison-message-is-dead-lettered-not-parked",
        ),
        # -- ids cancel withdrew (body deleted): dropped without a word, out of their set
        pytest.param(
            {LIST: ["r1", "r2"], MSGS: {"r2": "b2"}, WITHDRAWN: {"r1", "r9"}},
            2,
            "",
            0,
            [["r2", "b2"], [], [], 0, 0],
            {MSGS: {"r2": "b2"}, ACKS: {"r2"}, INFLIGHT: {"r2": entry(1)}, WITHDRAWN: {"r9"}},
            id="withdrawn-id-dropped-and-forgotten-the-next-claimed",
        ),
        pytest.param(
            {SUSPECTS: ["r1"], LIST: ["r2"], MSGS: {"r2": "b2"}, WITHDRAWN: {"r1"}},
            2,
            "",
            0,
            [["r2", "b2"], [], [], 0, 0],
            {MSGS: {"r2": "b2"}, ACKS: {"r2"}, INFLIGHT: {"r2": entry(1)}},
            id="withdrawn-suspect-dropped-and-the-queue-claimed-as-usual",
        ),
        pytest.param(
            {**PAUSED_JOB, LIST: ["r1"], PARKED_WITHDRAWN: {"r1", "r9"}},
            1,
            "",
            0,
            [[], [], [], 0, 0],
            {**PAUSED_JOB, PARKED_WITHDRAWN: {"r9"}},
            id="withdrawn-id-of-a-paused-job-met-before-it-was-parked-is-dropped",
        ),
    ],
)
def test_fetch_lane(
    env: Env,
    given: State,
    count: int,
    done_prefix: str,
    held: int,
    reply: list[Any],
    after: State,
) -> None:
    env.seed(given)

    assert env.fetch_lane(count, held, done_prefix=done_prefix) == reply

    env.assert_state(after)
    env.assert_expiry({BELL: BELL_TTL} if BELL in after else {})  # the bell was rung just now
    assert env.heartbeat("w1") == NOW


def test_fetch_lane_maintenance_recovers_a_dead_workers_message_as_a_suspect(env: Env) -> None:
    # Given: dead w0 held r1 (delivered once); r0 waits on the queue
    env.client.zadd(HEARTBEATS, {env.names["w0"]: DEAD_AT})
    env.seed(
        {
            LIST: ["r0"],
            MSGS: {"r0": "b0", "r1": "b1"},
            DEAD_ACKS: {"r1"},
            INFLIGHT: {"r1": earlier(1)},
        }
    )

    # When: idle w1 fetches two with maintenance
    result = env.fetch_lane(2, 0, done_prefix="", maintenance=True)

    # Then: r1 came back behind r0 (the bell rang); r0 was claimed, so r1 waits in the
    # suspects list, its entry (the dead worker's delivery) untouched
    assert result == [["r0", "b0"], [], [], 1, 0]
    env.assert_state(
        {
            MSGS: {"r0": "b0", "r1": "b1"},
            ACKS: {"r0"},
            INFLIGHT: {"r0": entry(1), "r1": earlier(1)},
            SUSPECTS: ["r1"],
            BELL: ["1"],
        }
    )
    assert env.heartbeat("w0") is None


# fetch_lane and the run history: a claim writes no record; a message dead-lettered at the
# max deliveries gets a "dead" record read off its body ("worker died during N deliveries"),
# kept the failed TTL, and a dead letter's note kept as long as dead letters.
KUMIKO_M2 = kumiko_message(
    "m2",
    job=TENANT_JOB,
    trigger="cron",
    failures=1,
    tenant="acme",
    origin="o1",
    dedup_key="k1",
    scheduled_at=TICK_AT,
)
DIED_M2 = died(
    "m2",
    2,
    job=TENANT_JOB,
    max_attempts=2,
    o="o1",
    t="acme",
    tr="cron",
    sa=TICK_AT,
    dk="k1",
)


@pytest.mark.parametrize(
    ("given", "root", "reply", "after", "expiry"),
    [
        pytest.param(
            {LIST: ["r1"], MSGS: {"r1": kumiko_message("m1")}},
            ROOT,
            [["r1", kumiko_message("m1")], [], [], 0, 0],
            {MSGS: {"r1": kumiko_message("m1")}, ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}},
            {},
            id="a-claim-writes-no-record-running-runs-live-in-the-in-flight-hash",
        ),
        pytest.param(
            {
                LIST: ["r1"],
                MSGS: {"r1": kumiko_message("m1")},
                INFLIGHT: {"r1": earlier(MAX_DELIVERIES)},
            },
            ROOT,
            [[], [], ["r1", MAX_DELIVERIES], 0, 0],
            {
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": kumiko_message("m1")},
                **indexed(died(), ENQUEUED_AT),
                dead_note("m1"): died_note("r1", died()),
            },
            {run_hash("m1"): FAILED_TTL, dead_note("m1"): DEAD_TTL},
            id="at-max-dead-record-and-note-read-off-the-message",
        ),
        pytest.param(
            {LIST: ["r2"], MSGS: {"r2": KUMIKO_M2}, INFLIGHT: {"r2": earlier(MAX_DELIVERIES)}},
            ROOT,
            [[], [], ["r2", MAX_DELIVERIES], 0, 0],
            {
                XQ: Z({"r2": NOW}),
                XQ_MSGS: {"r2": KUMIKO_M2},
                **indexed(DIED_M2, ENQUEUED_AT),
                dead_note("m2"): died_note("r2", DIED_M2),
            },
            {
                run_hash("m2"): FAILED_TTL,
                by_tenant("acme"): INDEX_TTL,
                by_origin("o1"): INDEX_TTL,
                dead_note("m2"): DEAD_TTL,
            },
            id="at-max-a-tenants-second-attempt-keeps-tenant-origin-schedule-and-key",
        ),
        pytest.param(
            {
                LIST: ["r1", "r2"],
                MSGS: {"r1": kumiko_message("m1"), "r2": kumiko_message("m2")},
                INFLIGHT: {"r2": earlier(MAX_DELIVERIES)},
            },
            "",
            [["r1", kumiko_message("m1")], [], ["r2", MAX_DELIVERIES], 0, 0],
            {
                MSGS: {"r1": kumiko_message("m1")},
                ACKS: {"r1"},
                INFLIGHT: {"r1": entry(1)},
                XQ: Z({"r2": NOW}),
                XQ_MSGS: {"r2": kumiko_message("m2")},
            },
            {},
            id="no-history-root-no-record-and-no-note",
        ),
    ],
)
def test_fetch_lane_run_history(
    env: Env, given: State, root: str, reply: list[Any], after: State, expiry: dict[str, int]
) -> None:
    env.seed(given)

    assert env.fetch_lane(2, 0, root=root) == reply

    env.assert_state(after)
    env.assert_expiry(expiry)


# The queue's doorbell rings iff a message went back (once, however many did).
REQUEUE_GIVEN: State = {
    LIST: ["r0"],
    MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
    ACKS: {"r1", "r2", "r3"},
    ACKS_W2: {"r4"},
}


@pytest.mark.parametrize(
    ("ids", "reply", "after"),
    [
        pytest.param(
            [],
            0,
            REQUEUE_GIVEN,
            id="no-ids",
        ),
        pytest.param(
            ["r2", "r1"],
            2,
            {
                LIST: ["r0", "r2", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r3"},
                ACKS_W2: {"r4"},
                BELL: ["1"],
            },
            id="owned-with-body-go-back-in-order-one-token",
        ),
        pytest.param(
            ["r1", "r3", "r4", "r9"],
            1,
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r2"},
                ACKS_W2: {"r4"},
                BELL: ["1"],
            },
            id="bodyless-and-foreign-and-unknown-stay-out",
        ),
        pytest.param(
            ["r3", "r4", "r9"],
            0,
            {
                LIST: ["r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r1", "r2"},
                ACKS_W2: {"r4"},
            },
            id="none-went-back-no-ring",
        ),
        pytest.param(
            ["r1", "r1"],
            1,
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r2", "r3"},
                ACKS_W2: {"r4"},
                BELL: ["1"],
            },
            id="an-id-given-twice-goes-back-once",
        ),
    ],
)
def test_requeue(env: Env, ids: list[str], reply: int, after: State) -> None:
    env.seed(REQUEUE_GIVEN)

    assert env.lua.requeue(keys=[NAMESPACE], args=[*env.head(), *ids]) == reply

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


# With KEYS[2] (a kumiko lane's in-flight hash), each id that goes back has its delivery
# undone: its deliveries count goes down by one (the rest of its entry kept) and the entry
# goes at 0 (never below); an owned id whose message is gone loses its entry.
@pytest.mark.parametrize(
    ("inflight", "ids", "lane", "reply", "after"),
    [
        pytest.param(
            {"r1": earlier(2), "r2": entry(1), "r3": entry(1), "r4": earlier(1)},
            ["r2", "r1"],
            True,
            2,
            {
                LIST: ["r0", "r2", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r3"},
                ACKS_W2: {"r4"},
                INFLIGHT: {"r1": earlier(1), "r3": entry(1), "r4": earlier(1)},
                BELL: ["1"],
            },
            id="counts-go-down-and-the-entry-goes-at-zero",
        ),
        pytest.param(
            {"r1": earlier(2), "r2": entry(1), "r3": entry(1), "r4": earlier(1), "r9": entry(1)},
            ["r3", "r4", "r9"],
            True,
            0,
            {
                LIST: ["r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r1", "r2"},
                ACKS_W2: {"r4"},
                INFLIGHT: {"r1": earlier(2), "r2": entry(1), "r4": earlier(1), "r9": entry(1)},
            },
            id="an-owned-bodyless-id-loses-its-entry-foreign-and-unknown-keep-theirs",
        ),
        pytest.param(
            {"r4": earlier(1)},
            ["r1"],
            True,
            1,
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r2", "r3"},
                ACKS_W2: {"r4"},
                INFLIGHT: {"r4": earlier(1)},
                BELL: ["1"],
            },
            id="no-entry-never-goes-negative",
        ),
        pytest.param(
            {"r1": earlier(12)},
            ["r1", "r1"],
            True,
            1,
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r2", "r3"},
                ACKS_W2: {"r4"},
                INFLIGHT: {"r1": earlier(11)},
                BELL: ["1"],
            },
            id="an-id-given-twice-is-undone-once-two-digit-count",
        ),
        pytest.param(
            {"r1": earlier(2), "r2": entry(1)},
            ["r2", "r1"],
            False,
            2,
            {
                LIST: ["r0", "r2", "r1"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r4": "b4"},
                ACKS: {"r3"},
                ACKS_W2: {"r4"},
                INFLIGHT: {"r1": earlier(2), "r2": entry(1)},
                BELL: ["1"],
            },
            id="without-the-hash-entries-stay",
        ),
    ],
)
def test_requeue_undoes_lane_deliveries(
    env: Env, inflight: dict[str, str], ids: list[str], lane: bool, reply: int, after: State
) -> None:
    env.seed({**REQUEUE_GIVEN, INFLIGHT: inflight})
    keys = [NAMESPACE, env.key(INFLIGHT)] if lane else [NAMESPACE]

    assert env.lua.requeue(keys=keys, args=[*env.head(), *ids]) == reply

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


# The in-flight hash across fetch_lane, requeue, maintenance and settle.
def _die(env: Env, worker: str, claimed_at: int) -> None:
    """``worker`` claimed at ``claimed_at`` and died: maintenance (w2, holding a message, so
    it claims nothing) recovers its claims once its heartbeat is past the timeout."""
    env.fetch_lane(0, 1, worker="w2", now=claimed_at + HEARTBEAT_TIMEOUT + 1, maintenance=True)
    assert env.heartbeat(worker) is None


def test_a_delivery_undone_by_requeue_leaves_no_entry_and_no_suspect(env: Env) -> None:
    # Given: w1 claimed r1 (kumiko's m1), a full batch leaving r2 (the bell rang)
    env.seed({LIST: ["r1", "r2"], MSGS: {"r1": kumiko_message("m1"), "r2": "b2"}})
    assert env.fetch_lane(1) == [["r1", kumiko_message("m1")], [], [], 0, 0]
    env.assert_state(
        {
            LIST: ["r2"],
            MSGS: {"r1": kumiko_message("m1"), "r2": "b2"},
            ACKS: {"r1"},
            INFLIGHT: {"r1": entry(1)},
            BELL: ["1"],
        }
    )

    # When: the worker shuts down and requeues it, then fetches two
    requeued = env.lua.requeue(
        keys=[NAMESPACE, env.key(INFLIGHT)], args=[*env.head(now=NOW + 1), "r1"]
    )
    refetched = env.fetch_lane(2, now=NOW + 2)

    # Then: r1 went back with no entry, so it is claimed beside r2 like any message (the
    # token nobody took still waits)
    assert requeued == 1
    assert refetched == [["r2", "b2", "r1", kumiko_message("m1")], [], [], 0, 0]
    env.assert_state(
        {
            MSGS: {"r1": kumiko_message("m1"), "r2": "b2"},
            ACKS: {"r1", "r2"},
            INFLIGHT: {"r1": entry(1, NOW + 2), "r2": entry(1, NOW + 2)},
            BELL: ["1"],
        }
    )


def test_a_crashed_delivery_runs_alone_and_its_record_counts_the_deliveries(env: Env) -> None:
    # Given: w0 claimed r1 (kumiko's m1) and died; r2 waits behind it (the bell rang, and
    # nobody takes its token in this test)
    env.seed({LIST: ["r1", "r2"], MSGS: {"r1": kumiko_message("m1"), "r2": "b2"}})
    env.fetch_lane(1, worker="w0", now=CLAIMED_AT)
    _die(env, "w0", CLAIMED_AT)
    env.assert_state(
        {
            LIST: ["r2", "r1"],
            MSGS: {"r1": kumiko_message("m1"), "r2": "b2"},
            INFLIGHT: {"r1": entry(1, CLAIMED_AT)},
            BELL: ["1"],
        }
    )

    # When: idle w1 fetches (r2 comes first, so r1 is set aside), settles r2, fetches again
    first = env.fetch_lane(2, now=NOW - 2)
    assert env.settle("ack", rid="r2", now=NOW - 2) == 1
    second = env.fetch_lane(2, now=NOW - 1)

    # Then: r1 ran alone, its second delivery counted
    assert first == [["r2", "b2"], [], [], 1, 0]
    assert second == [["r1", kumiko_message("m1")], [], [], 0, 1]
    env.assert_state(
        {
            MSGS: {"r1": kumiko_message("m1")},
            ACKS: {"r1"},
            INFLIGHT: {"r1": entry(2, NOW - 1)},
            BELL: ["1"],
        }
    )

    # When: it completes
    assert env.settle("completed", run_header=header_of(ended()), run=ended()) == 1

    # Then: the entry is gone and the record says 2 deliveries
    env.assert_state({DONE_M1: "1", BELL: ["1"], **indexed(ended(n=2), NOW)})


def test_a_message_whose_worker_dies_max_deliveries_times_is_dead_lettered(env: Env) -> None:
    # Given: r1 (kumiko's m1); each time a worker claims it, that worker dies
    env.seed({LIST: ["r1"], MSGS: {"r1": kumiko_message("m1")}})
    for delivery in range(1, MAX_DELIVERIES + 1):
        claimed_at = CLAIMED_AT + delivery * 1_000
        claimed = env.fetch_lane(1, worker="w0", now=claimed_at)
        assert claimed == [["r1", kumiko_message("m1")], [], [], 0, int(delivery > 1)]
        assert env.client.hget(env.key(INFLIGHT), "r1") == entry(delivery, claimed_at).encode()
        _die(env, "w0", claimed_at)

    # When: the next fetch meets it
    reply = env.fetch_lane(1)

    # Then: it is dead-lettered, its entry dropped, its record and note written (the bell
    # holds the one token its first recovery rang, nobody having taken it)
    assert reply == [[], [], ["r1", MAX_DELIVERIES], 0, 0]
    env.assert_state(
        {
            XQ: Z({"r1": NOW}),
            XQ_MSGS: {"r1": kumiko_message("m1")},
            BELL: ["1"],
            **indexed(died(), ENQUEUED_AT),
            dead_note("m1"): died_note("r1", died()),
        }
    )
    env.assert_expiry({run_hash("m1"): FAILED_TTL, dead_note("m1"): DEAD_TTL, BELL: BELL_TTL})
