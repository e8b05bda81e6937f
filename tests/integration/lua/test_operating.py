"""State tables of the operators' scripts: ``resume`` (a paused job's parked messages),
``purge``, ``qsize`` and ``cancel``. Rows and helpers: :mod:`tests.integration.lua.tables`."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.lua.tables import (
    ACKS,
    ACKS_W2,
    ALIVE_AT,
    ATTEMPTS,
    BELL,
    BELL_TTL,
    CANCEL_M1,
    CANCELLED_M1,
    COMPLETED_TTL,
    DEDUP_M1_INDEX,
    DQ,
    DQ_ACKS,
    DQ_ACKS_W2,
    DQ_LIST,
    DQ_MSGS,
    ENQUEUED_AT,
    FAILED_TTL,
    HEARTBEATS,
    INDEX_TTL,
    INFLIGHT,
    JOB,
    LIST,
    MSGS,
    NAMESPACE,
    NOW,
    PARKED,
    PARKED_WITHDRAWN,
    PAUSED,
    PAUSED_JOB,
    PLACES,
    QUEUE,
    ROOT,
    SCHEDULE,
    SHORT_TTL,
    SUSPECTS,
    TTL,
    WITHDRAWN,
    XQ,
    XQ_MSGS,
    Env,
    J,
    State,
    Z,
    by_origin,
    earlier,
    entry,
    indexed,
    kumiko_message,
    record,
    run_hash,
    text,
)

# The job leaves the paused set; its parked messages go back to the head of its queue, in
# their parked order, except those to drop (cron ticks its misfire policy skips): deleted,
# their run record "cancelled". The queue's doorbell rings iff any went back.
RESUME_OTHER_JOB = "app:job:other"
SKIPPED_M2 = record(
    "m2", 1, "cancelled", q=ENQUEUED_AT, w="", en=NOW, em="skipped on resume (misfire)"
)


@pytest.mark.parametrize(
    ("given", "step", "drop", "reply", "after", "expiry"),
    [
        pytest.param(
            {
                **PAUSED_JOB,
                PARKED: ["r1", "r2"],
                LIST: ["r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2"},
            },
            1000,
            [],
            [1, 2, 0, 0],
            {LIST: ["r1", "r2", "r0"], MSGS: {"r0": "b0", "r1": "b1", "r2": "b2"}, BELL: ["1"]},
            {BELL: BELL_TTL},
            id="parked-go-back-ahead-in-their-order-one-token",
        ),
        pytest.param(
            {
                **PAUSED_JOB,
                PARKED: ["r1", "r2", "r3"],
                LIST: ["r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r3": "b3"},
            },
            2,
            [],
            [1, 2, 0, 1],
            {
                PARKED: ["r1"],
                LIST: ["r2", "r3", "r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r3": "b3"},
                BELL: ["1"],
            },
            {BELL: BELL_TTL},
            id="a-step-takes-the-last-parked-first-and-says-how-many-are-left",
        ),
        pytest.param(
            {
                PARKED: ["r1"],
                LIST: ["r2", "r3", "r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r3": "b3"},
            },
            2,
            [],
            [0, 1, 0, 0],
            {
                LIST: ["r1", "r2", "r3", "r0"],
                MSGS: {"r0": "b0", "r1": "b1", "r2": "b2", "r3": "b3"},
                BELL: ["1"],
            },
            {BELL: BELL_TTL},
            id="the-next-step-finishes-in-parked-order-though-no-longer-paused",
        ),
        pytest.param(
            {
                PAUSED: {JOB, RESUME_OTHER_JOB},
                PARKED: ["r1", "r2", "r3"],
                MSGS: {"r1": "b1", "r2": kumiko_message("m2"), "r3": "b3"},
            },
            1000,
            ["r2"],
            [1, 2, 1, 0],
            {
                PAUSED: {RESUME_OTHER_JOB},
                LIST: ["r1", "r3"],
                MSGS: {"r1": "b1", "r3": "b3"},
                BELL: ["1"],
                **indexed(SKIPPED_M2, ENQUEUED_AT),
            },
            {BELL: BELL_TTL, run_hash("m2"): COMPLETED_TTL},
            id="one-dropped-its-record-cancelled-the-rest-go-back-and-ring",
        ),
        pytest.param(
            {
                **PAUSED_JOB,
                PARKED: ["r1", "r2"],
                PARKED_WITHDRAWN: {"r2"},
                MSGS: {"r1": "b1"},
            },
            1000,
            [],
            [1, 1, 0, 0],
            {LIST: ["r1"], MSGS: {"r1": "b1"}, BELL: ["1"]},
            {BELL: BELL_TTL},
            id="one-cancelled-while-parked-is-dropped-and-the-withdrawn-set-goes",
        ),
        pytest.param(
            {**PAUSED_JOB, PARKED: ["r1"], LIST: ["r0"], MSGS: {"r0": "b0", "r1": "b1"}},
            1000,
            ["r1"],
            [1, 0, 1, 0],
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            {},
            id="all-dropped-none-went-back-no-ring",
        ),
        pytest.param(
            {**PAUSED_JOB, LIST: ["r0"], MSGS: {"r0": "b0"}},
            1000,
            [],
            [1, 0, 0, 0],
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            {},
            id="nothing-parked-no-ring",
        ),
        pytest.param(
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            1000,
            [],
            [0, 0, 0, 0],
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            {},
            id="not-paused-nothing-parked-nothing-done",
        ),
    ],
)
def test_resume(
    env: Env,
    given: State,
    step: int,
    drop: list[str],
    reply: list[int],
    after: State,
    expiry: dict[str, int],
) -> None:
    env.seed(given)

    result = env.lua.resume(
        keys=[
            env.key(PAUSED),
            env.key(PARKED),
            env.key(LIST),
            env.key(MSGS),
            env.key(PARKED_WITHDRAWN),
        ],
        args=[JOB, env.key(ROOT), NOW, COMPLETED_TTL, FAILED_TTL, step, *drop],
    )

    assert result == reply
    env.assert_state(after)
    env.assert_expiry(expiry)


PURGE_GIVEN: State = {
    LIST: ["r1"],
    MSGS: {"r1": "b1", "r2": "b2"},
    ACKS: {"r2"},
    ACKS_W2: {"r3"},
    XQ: Z({"x1": NOW}),
    XQ_MSGS: {"x1": "bx"},
    DQ_LIST: ["d1"],
    DQ_MSGS: {"d1": "bd", "d2": "bd2"},
    DQ_ACKS: {"d2"},
    DQ_ACKS_W2: {"d3"},
}


@pytest.mark.parametrize(
    ("queue", "after"),
    [
        pytest.param(
            QUEUE,
            {
                ACKS_W2: {"r3"},
                DQ_LIST: ["d1"],
                DQ_MSGS: {"d1": "bd", "d2": "bd2"},
                DQ_ACKS: {"d2"},
                DQ_ACKS_W2: {"d3"},
            },
            id="queue",
        ),
        pytest.param(
            DQ,
            {
                LIST: ["r1"],
                MSGS: {"r1": "b1", "r2": "b2"},
                ACKS: {"r2"},
                ACKS_W2: {"r3"},
                DQ_ACKS_W2: {"d3"},
            },
            id="delay-queue-also-drops-the-canonical-xq",
        ),
    ],
)
def test_purge(env: Env, queue: str, after: State) -> None:
    env.seed(PURGE_GIVEN)

    assert env.lua.purge(keys=[NAMESPACE], args=env.head(queue)) is None

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


@pytest.mark.parametrize("queue", [pytest.param(QUEUE, id="queue"), pytest.param(DQ, id="dq")])
def test_qsize_counts_queue_and_delay_queue_with_own_claims(env: Env, queue: str) -> None:
    env.seed(
        {
            LIST: ["r1", "r2"],  # the list is not counted: its ids are counted in MSGS
            MSGS: {"r1": "b", "r2": "b"},
            ACKS: {"r3"},
            ACKS_W2: {"r4", "r5"},  # another worker's claims are not counted
            DQ_MSGS: {"d1": "b"},
            DQ_ACKS: {"d2", "d3"},
            XQ: Z({"x1": NOW}),  # nor are dead letters
            XQ_MSGS: {"x1": "b"},
        }
    )

    assert env.lua.qsize(keys=[NAMESPACE], args=env.head(queue)) == 2 + 1 + 1 + 2
    assert env.heartbeat("w1") == NOW


def test_qsize_of_nothing_is_zero(env: Env) -> None:
    assert env.lua.qsize(keys=[NAMESPACE], args=env.head()) == 0


# cancel(m1) looks in the lane queue and its delay queue: a message waiting (queue, suspects,
# parked, delay queue) is removed with its in-flight entry; one held in a live worker's memory
# until due gets the cancel marker until due + GRACE (its move drops it); either way its run
# record says "cancelled" (no worker) and a dedup key it holds is freed. Claimed from the lane
# queue: it runs, nothing changes.
RESEND_WINDOW = 60_000
SENT_R1 = "kumiko:{p}:sent:r1"  # the tombstone of a message taken off a lane queue
SENT_R5 = "kumiko:{p}:sent:r5"
GRACE = 3_600_000
DEDUP_M1 = "kumiko:{p}:dedup:app:job:sync:k1"
KEYED_M1 = kumiko_message("m1", dedup_key="k1")
DELAYED_M1 = kumiko_message("m1", eta=NOW + 10_000)
HANDOFF_M5 = kumiko_message("m5", trigger="requeue", origin="m1")
CANCELLED_M5 = record("m5", 1, "cancelled", q=ENQUEUED_AT, en=NOW, o="m1", tr="requeue")


@pytest.mark.parametrize(
    ("given", "reply", "after", "expiry"),
    [
        pytest.param({}, [0, "gone"], {}, {}, id="gone"),
        pytest.param(
            {LIST: ["r9"], MSGS: {"r9": kumiko_message("m1")}},
            [0, "gone"],
            {LIST: ["r9"], MSGS: {"r9": kumiko_message("m1")}},
            {},
            id="only-the-places-given-are-read",
        ),
        pytest.param(
            {MSGS: {"r1": kumiko_message("m9")}},
            [0, "gone"],
            {MSGS: {"r1": kumiko_message("m9")}},
            {},
            id="another-message-at-a-place-is-left-alone",
        ),
        pytest.param(
            indexed(CANCELLED_M1, ENQUEUED_AT),
            [0, "ended"],
            indexed(CANCELLED_M1, ENQUEUED_AT),
            {},
            id="ended-it-has-a-run-record",
        ),
        pytest.param(
            {"kumiko:{p}:dead:m1": "{}"},
            [0, "ended"],
            {"kumiko:{p}:dead:m1": "{}"},
            {},
            id="ended-it-has-a-dead-letter-note",
        ),
        pytest.param(
            {LIST: ["r0", "r1"], MSGS: {"r0": "b0", "r1": kumiko_message("m1")}},
            [1, QUEUE, "r1"],
            {
                LIST: ["r0", "r1"],
                MSGS: {"r0": "b0"},
                WITHDRAWN: {"r1"},
                SENT_R1: "1",
                **indexed(CANCELLED_M1, ENQUEUED_AT),
            },
            {run_hash("m1"): COMPLETED_TTL, SENT_R1: RESEND_WINDOW},
            id="waiting-in-the-queue-body-deleted-id-withdrawn-record-cancelled",
        ),
        pytest.param(
            {
                SUSPECTS: ["r1"],
                MSGS: {"r1": kumiko_message("m1")},
                INFLIGHT: {"r1": earlier(1), "r2": entry(1)},
            },
            [1, QUEUE, "r1"],
            {
                SUSPECTS: ["r1"],
                WITHDRAWN: {"r1"},
                INFLIGHT: {"r2": entry(1)},
                SENT_R1: "1",
                **indexed(CANCELLED_M1, ENQUEUED_AT),
            },
            {run_hash("m1"): COMPLETED_TTL, SENT_R1: RESEND_WINDOW},
            id="waiting-suspect-withdrawn-with-its-in-flight-entry",
        ),
        pytest.param(
            {**PAUSED_JOB, PARKED: ["r1", "r2"], MSGS: {"r1": kumiko_message("m1"), "r2": "b2"}},
            [1, QUEUE, "r1"],
            {
                **PAUSED_JOB,
                PARKED: ["r1", "r2"],
                PARKED_WITHDRAWN: {"r1"},
                MSGS: {"r2": "b2"},
                SENT_R1: "1",
                **indexed(CANCELLED_M1, ENQUEUED_AT),
            },
            {run_hash("m1"): COMPLETED_TTL, SENT_R1: RESEND_WINDOW},
            id="parked-withdrawn-from-its-job",
        ),
        pytest.param(
            {MSGS: {"r1": kumiko_message("m1")}, ACKS_W2: {"r1"}, INFLIGHT: {"r1": entry(1)}},
            [0, "running"],
            {MSGS: {"r1": kumiko_message("m1")}, ACKS_W2: {"r1"}, INFLIGHT: {"r1": entry(1)}},
            {},
            id="claimed-from-the-lane-queue-runs-nothing-changed",
        ),
        pytest.param(
            {DQ_MSGS: {"d1": DELAYED_M1, "d2": "b2"}, SCHEDULE: Z({"d1": 9, "d2": 10})},
            [1, DQ, "d1"],
            {DQ_MSGS: {"d2": "b2"}, SCHEDULE: Z({"d2": 10}), **indexed(CANCELLED_M1, ENQUEUED_AT)},
            {run_hash("m1"): COMPLETED_TTL},
            id="on-the-schedule-leaves-it-with-its-body",
        ),
        pytest.param(
            {DQ_LIST: ["d1"], DQ_MSGS: {"d1": DELAYED_M1}},
            [1, DQ, "d1"],
            {DQ_LIST: ["d1"], **indexed(CANCELLED_M1, ENQUEUED_AT)},
            {run_hash("m1"): COMPLETED_TTL},
            id="waiting-in-an-older-versions-delay-queue-list-body-deleted",
        ),
        pytest.param(
            {DQ_MSGS: {"d1": DELAYED_M1}, DQ_ACKS_W2: {"d1"}},
            [1, DQ, "d1"],
            {
                DQ_MSGS: {"d1": DELAYED_M1},
                DQ_ACKS_W2: {"d1"},
                CANCEL_M1: "1",
                **indexed(CANCELLED_M1, ENQUEUED_AT),
            },
            {CANCEL_M1: 10_000 + GRACE, run_hash("m1"): COMPLETED_TTL},
            id="held-until-due-by-a-live-worker-marked-until-due-plus-grace",
        ),
        pytest.param(
            {DQ_MSGS: {"d1": DELAYED_M1}, DQ_ACKS_W2: {"d1"}, CANCEL_M1: "1"},
            [0, "ended"],
            {DQ_MSGS: {"d1": DELAYED_M1}, DQ_ACKS_W2: {"d1"}, CANCEL_M1: "1"},
            {},
            id="held-until-due-and-marked-already-ended",
        ),
        pytest.param(
            {
                LIST: ["r1"],
                MSGS: {"r1": KEYED_M1},
                DEDUP_M1: {"id": "m1", "state": "queued"},
                DEDUP_M1_INDEX: Z({"k1": 5, "k2": 6}),
            },
            [1, QUEUE, "r1"],
            {
                LIST: ["r1"],
                WITHDRAWN: {"r1"},
                DEDUP_M1_INDEX: Z({"k2": 6}),
                SENT_R1: "1",
                **indexed(J({**CANCELLED_M1, "dk": "k1"}), ENQUEUED_AT),
            },
            {run_hash("m1"): COMPLETED_TTL, SENT_R1: RESEND_WINDOW},
            id="its-dedup-key-is-freed-and-out-of-the-index",
        ),
        pytest.param(
            {
                LIST: ["r1"],
                MSGS: {"r1": KEYED_M1},
                DEDUP_M1: {"id": "m7", "state": "queued"},
                DEDUP_M1_INDEX: Z({"k1": 5}),
            },
            [1, QUEUE, "r1"],
            {
                LIST: ["r1"],
                WITHDRAWN: {"r1"},
                DEDUP_M1: {"id": "m7", "state": "queued"},
                DEDUP_M1_INDEX: Z({"k1": 5}),
                SENT_R1: "1",
                **indexed(J({**CANCELLED_M1, "dk": "k1"}), ENQUEUED_AT),
            },
            {run_hash("m1"): COMPLETED_TTL, SENT_R1: RESEND_WINDOW},
            id="a-dedup-key-now-another-ids-is-kept",
        ),
        pytest.param(
            {LIST: ["r5"], MSGS: {"r5": HANDOFF_M5}},
            [1, QUEUE, "r5"],
            {LIST: ["r5"], WITHDRAWN: {"r5"}, SENT_R5: "1", **indexed(CANCELLED_M5, ENQUEUED_AT)},
            {run_hash("m5"): COMPLETED_TTL, by_origin("m1"): INDEX_TTL, SENT_R5: RESEND_WINDOW},
            id="a-hand-off-carrying-the-id-on-is-cancelled",
        ),
    ],
)
def test_cancel(
    env: Env, given: State, reply: list[Any], after: State, expiry: dict[str, int]
) -> None:
    env.seed(given)
    env.client.zadd(HEARTBEATS, {env.names["w2"]: ALIVE_AT})  # w2 is a live worker

    result = env.lua.cancel(
        keys=[NAMESPACE],
        args=[
            env.key(ROOT),
            "m1",
            NOW,
            COMPLETED_TTL,
            FAILED_TTL,
            GRACE,
            RESEND_WINDOW,
            "",
            *(env.key(place) for place in PLACES),
        ],
    )

    assert text(result) == [env.key(item) if isinstance(item, str) else item for item in reply]
    env.assert_state(after)
    env.assert_expiry(expiry)


@pytest.mark.parametrize(
    ("given", "ttl", "reply", "expiry"),
    [
        pytest.param(None, None, 1, TTL, id="first-attempt-opens-the-window"),
        pytest.param("4", SHORT_TTL, 5, SHORT_TTL, id="later-attempts-keep-the-window"),
        pytest.param("4", None, 5, TTL, id="a-counter-without-ttl-gets-one"),
    ],
)
def test_count_attempt(
    env: Env, given: str | None, ttl: int | None, reply: int, expiry: int
) -> None:
    if given is not None:
        env.seed({ATTEMPTS: given})
    if ttl is not None:
        env.expire(ATTEMPTS, ttl)

    assert env.lua.count_attempt(keys=[env.key(ATTEMPTS)], args=[TTL]) == reply

    env.assert_state({ATTEMPTS: str(reply)})
    env.assert_ttls({ATTEMPTS: expiry})
