"""State tables of the scripts that end a delivery: ``ack``, ``settle`` (every outcome, the
retry or hand-off it enqueues, the run record it writes and the trimming it does, a delivery
that maintenance recovered meanwhile) and ``nack``. Rows and helpers:
:mod:`tests.integration.lua.tables`."""

from __future__ import annotations

import json

import pytest
import redis

from tests.integration.lua.tables import (
    ACKS,
    ACKS_W2,
    BELL,
    BELL_TTL,
    COMPLETED_TTL,
    COUNTS,
    DEAD_TTL,
    DEDUP_INDEX,
    DONE_M1,
    DQ,
    DQ_ACKS,
    DQ_BELL,
    DQ_LIST,
    DQ_MSGS,
    ENQUEUED_AT,
    FAILED_M1,
    FAILED_TTL,
    INDEX_TTL,
    INFLIGHT,
    JOB,
    LIST,
    MSGS,
    NAMESPACE,
    NO_TTL,
    NOW,
    OTHER_RUN_WORKER,
    PAST_COMPLETED_AGE,
    QUEUE,
    RECORD,
    ROOT,
    RUN_WORKER,
    SECOND_ATTEMPT,
    SENT,
    SUSPECTS,
    TENANT_JOB,
    TTL,
    XQ,
    XQ_MSGS,
    Env,
    J,
    State,
    Z,
    by_job,
    by_origin,
    by_status,
    by_tenant,
    dead_note,
    earlier,
    ended,
    entry,
    header,
    header_of,
    indexed,
    kumiko_message,
    merge,
    message,
    record,
    run_hash,
    text,
)


@pytest.mark.parametrize(
    ("given", "reply", "after"),
    [
        pytest.param(
            {MSGS: {"r1": "b1", "r2": "b2"}, ACKS: {"r1", "r2"}},
            1,
            {MSGS: {"r2": "b2"}, ACKS: {"r2"}},
            id="owned",
        ),
        pytest.param(
            {MSGS: {"r1": "b1"}, ACKS_W2: {"r1"}},
            0,
            {MSGS: {"r1": "b1"}, ACKS_W2: {"r1"}},
            id="not-owned",
        ),
        pytest.param(
            {MSGS: {"r1": "b1"}, ACKS: {"r1"}, DONE_M1: "1", INFLIGHT: {"r1": entry(1)}},
            1,
            {DONE_M1: "1", INFLIGHT: {"r1": entry(1)}},
            id="kumiko-records-untouched",
        ),
    ],
)
def test_ack(env: Env, given: State, reply: int, after: State) -> None:
    env.seed(given)

    assert env.lua.ack(keys=[NAMESPACE], args=[*env.head(), "r1"]) == reply

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


# A call for a delivery of w1's removes r1's in-flight entry (r2's stays); one no longer w1's
# (w2 holds r1) leaves the entry, w2's now, as it was; "completed" writes the marker even
# when the delivery is no longer this worker's; an enqueued retry rings its queue's doorbell.
# These rows write no run record (header ""): see test_settle_writes_the_run_record.
R2_ENTRY = {"r2": earlier(1)}
SETTLE_OWNED: State = {
    MSGS: {"r1": "b1", "r0": "b0"},
    ACKS: {"r1"},
    INFLIGHT: {"r1": entry(1), **R2_ENTRY},
}
SETTLE_FOREIGN: State = {
    MSGS: {"r1": "b1"},
    ACKS_W2: {"r1"},
    INFLIGHT: {"r1": entry(2), **R2_ENTRY},
}


@pytest.mark.parametrize(
    ("given", "outcome", "retry_queue", "reply", "after", "expiry"),
    [
        pytest.param(
            SETTLE_OWNED,
            "ack",
            None,
            1,
            {MSGS: {"r0": "b0"}, INFLIGHT: R2_ENTRY},
            {},
            id="ack-owned",
        ),
        pytest.param(
            SETTLE_FOREIGN,
            "ack",
            None,
            0,
            SETTLE_FOREIGN,
            {},
            id="ack-not-owned-changes-nothing",
        ),
        pytest.param(
            {MSGS: {"r1": "b1"}, ACKS: {"r1"}},
            "ack",
            None,
            1,
            {},
            {},
            id="ack-without-an-entry",
        ),
        pytest.param(
            SETTLE_OWNED,
            "completed",
            None,
            1,
            {MSGS: {"r0": "b0"}, INFLIGHT: R2_ENTRY, DONE_M1: "1"},
            {DONE_M1: TTL},
            id="completed-owned-sets-the-marker",
        ),
        pytest.param(
            SETTLE_FOREIGN,
            "completed",
            None,
            0,
            {**SETTLE_FOREIGN, DONE_M1: "1"},
            {DONE_M1: TTL},
            id="completed-not-owned-still-sets-the-marker",
        ),
        pytest.param(
            SETTLE_OWNED,
            "retry",
            QUEUE,
            1,
            {LIST: ["r3"], MSGS: {"r0": "b0", "r3": "retry"}, INFLIGHT: R2_ENTRY, BELL: ["1"]},
            {BELL: BELL_TTL},
            id="retry-owned-on-the-queue-rings",
        ),
        pytest.param(
            SETTLE_OWNED,
            "retry",
            DQ,
            1,
            {
                MSGS: {"r0": "b0"},
                DQ_LIST: ["r3"],
                DQ_MSGS: {"r3": "retry"},
                INFLIGHT: R2_ENTRY,
                DQ_BELL: ["1"],
            },
            {DQ_BELL: BELL_TTL},
            id="retry-owned-on-the-delay-queue-rings-its-bell",
        ),
        pytest.param(
            SETTLE_FOREIGN,
            "retry",
            QUEUE,
            0,
            SETTLE_FOREIGN,
            {},
            id="retry-not-owned-enqueues-nothing",
        ),
        pytest.param(
            SETTLE_OWNED,
            "dead",
            None,
            1,
            {
                MSGS: {"r0": "b0"},
                INFLIGHT: R2_ENTRY,
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
            },
            {},
            id="dead-owned-dead-letters",
        ),
        pytest.param(
            {ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}},
            "dead",
            None,
            1,
            {},
            {},
            id="dead-owned-without-body-drops-the-claim-and-the-entry",
        ),
        pytest.param(
            SETTLE_FOREIGN,
            "dead",
            None,
            0,
            SETTLE_FOREIGN,
            {},
            id="dead-not-owned-moves-nothing",
        ),
    ],
)
def test_settle(
    env: Env,
    given: State,
    outcome: str,
    retry_queue: str | None,
    reply: int,
    after: State,
    expiry: dict[str, int],
) -> None:
    env.seed(given)
    retry = None if retry_queue is None else (retry_queue, "r3", "retry")

    assert env.settle(outcome, retry=retry) == reply

    env.assert_state(after)
    env.assert_expiry(expiry)
    assert env.heartbeat("w1") == NOW


# The broker sends r1's "sent" key with every outcome but "completed": a delivery of this
# worker's whose body goes otherwise (a retry or hand-off, a dead letter, a plain ack) leaves
# it as a tombstone for the resend window, so a re-sent enqueue of r1's first write finds it
# (include/guarded.lua); one no longer this worker's writes none (its body is not deleted
# here); a completed one writes its "already completed" marker instead.
TOMBSTONE_TTL = 90_000


@pytest.mark.parametrize(
    ("given", "outcome", "tombstone"),
    [
        pytest.param(SETTLE_OWNED, "ack", True, id="ack-owned"),
        pytest.param(SETTLE_OWNED, "retry", True, id="retry-owned"),
        pytest.param(SETTLE_OWNED, "dead", True, id="dead-owned"),
        pytest.param(SETTLE_FOREIGN, "ack", False, id="ack-not-owned"),
        pytest.param(SETTLE_FOREIGN, "dead", False, id="dead-not-owned"),
        pytest.param(SETTLE_OWNED, "completed", False, id="completed-marker-instead"),
    ],
)
def test_settle_leaves_a_sent_tombstone_where_a_body_ends_otherwise(
    env: Env, given: State, outcome: str, tombstone: bool
) -> None:
    env.seed(given)
    retry = (QUEUE, "r3", "retry") if outcome == "retry" else None

    env.settle(outcome, retry=retry, tombstone_ttl=TOMBSTONE_TTL)

    if tombstone:
        assert env.client.get(env.key(SENT)) == b"1"
        env.assert_ttls({SENT: TOMBSTONE_TTL})
    else:
        assert not env.client.exists(env.key(SENT))
    assert bool(env.client.exists(env.key(DONE_M1))) == (outcome == "completed")


@pytest.mark.parametrize(
    ("bodies", "mode", "counted_in", "after"),
    [
        pytest.param(
            {"r1": "a", "r2": "a"}, "r", "", {"q:a": 0, "q:b": 1}, id="ready-each-uncounted"
        ),
        pytest.param({"r2": "a"}, "r", "", {"q:a": 1, "q:b": 1}, id="a-body-gone-meanwhile"),
        pytest.param({"r1": "a", "r2": "b"}, "r", "", {"q:a": 1, "q:b": 0}, id="each-by-its-actor"),
        pytest.param(
            {"r1": "a", "r2": "a"}, "b", "seen", {"q:a": 1, "q:b": 1}, id="backfill-saw-one"
        ),
        pytest.param({"r1": "a", "r2": "a"}, "b", "fresh", {"q:a": 1, "q:b": 1}, id="one-fresh"),
        pytest.param({"r1": "a", "r2": "a"}, None, "", {"q:a": 2, "q:b": 1}, id="not-kept-yet"),
    ],
)
@pytest.mark.parametrize("actors_known", [False, True], ids=["read-off-the-body", "given"])
def test_settle_uncounts_the_bodies_it_deletes(
    env: Env,
    bodies: dict[str, str],
    mode: str | None,
    counted_in: str,
    after: dict[str, int],
    actors_known: bool,
) -> None:
    # Given r1 and r2 claimed by w1, r1's body maybe gone meanwhile (a purge while it ran),
    # the counts ready, being backfilled (r1 counted by the backfill or written since it
    # began: r2 neither) or not kept yet
    counts: dict[str, str] = {"q:a": "2", "q:b": "1"}
    if mode is not None:
        counts["~mode"] = mode
    given: State = {
        ACKS: {"r1", "r2"},
        INFLIGHT: {"r1": entry(1), "r2": entry(1)},
        MSGS: {rid: message(f"m-{rid}", actor) for rid, actor in bodies.items()},
        COUNTS: counts,
    }
    if counted_in:
        given[f"{COUNTS}:{counted_in}"] = {"qr1"}
    env.seed(given)

    # When both are acked in one settle call, with the actor names the worker decoded (as
    # it had them before a body went: "a" for one gone) or without
    args: list[str | int] = [*env.head(), f"2 {TTL} {COMPLETED_TTL} {FAILED_TTL} 100 0", ""]
    for rid in ("r1", "r2"):
        actor = bodies.get(rid, "a") if actors_known else ""
        args += [rid, "ack", "", *[""] * 5, "", actor, ""]
    replies = env.lua.settle(keys=[NAMESPACE, env.key(INFLIGHT), env.key(SUSPECTS)], args=args)

    # Then the bodies are gone, each counted down iff it was there and counted
    assert replies == [1, 1]
    assert not env.client.exists(env.key(MSGS))
    found = env.client.hmget(env.key(COUNTS), list(after))
    assert dict(zip(after, (int(value or 0) for value in found), strict=True)) == after
    assert not env.client.exists(env.key(f"{COUNTS}:seen"), env.key(f"{COUNTS}:fresh"))


FOLLOW_UP = {"fid": "m7", "fpayload": "{}", "ftrigger": "manual"}


# The job of r1 (message m1) ended for good holding dedup key k1: its ack (completed, or dead
# after a final failure) frees the key's record and index entry iff the record still points at
# m1 and holds no follow-up; a record that moved on, or is gone, is not touched. One that holds
# a follow-up leaves the whole delivery untouched (reply 2: the worker hands the key over, then
# settles again without it), so a kill in between leaves the message to be redelivered.
# Settling again (a reply lost) frees nothing more.
@pytest.mark.parametrize(
    ("record_given", "freed"),
    [
        pytest.param({"id": "m1", "state": "running"}, True, id="freed"),
        pytest.param({"id": "m2", "state": "queued"}, False, id="moved-on"),
        pytest.param(None, False, id="gone"),
    ],
)
@pytest.mark.parametrize("outcome", ["completed", "dead"])
def test_settle_ends_a_dedup_key(
    env: Env, outcome: str, record_given: dict[str, str] | None, freed: bool
) -> None:
    given: State = {**SETTLE_OWNED, DEDUP_INDEX: Z({"k1": NOW + TTL, "k2": NOW + TTL})}
    if record_given is not None:
        given[RECORD] = record_given
    env.seed(given)
    key_end = env.key(DEDUP_INDEX) + "\tm1\tk1"

    assert env.settle(outcome, dedup=key_end) == 1

    record_after = text(env.client.hgetall(env.key(RECORD)))
    index_after = env.client.zrange(env.key(DEDUP_INDEX), 0, -1)
    if freed:
        assert record_after == {}
        assert index_after == [b"k2"]
    else:
        assert record_after == (record_given or {})
        assert index_after == [b"k1", b"k2"]
    assert not env.client.sismember(env.key(ACKS), "r1")
    assert env.settle(outcome, dedup=key_end) == 0  # no longer this worker's
    assert text(env.client.hgetall(env.key(RECORD))) == record_after


@pytest.mark.parametrize("outcome", ["completed", "dead"])
def test_settle_leaves_a_delivery_whose_dedup_key_has_a_follow_up(env: Env, outcome: str) -> None:
    given: State = {
        **SETTLE_OWNED,
        RECORD: {"id": "m1", "state": "running", **FOLLOW_UP},
        DEDUP_INDEX: Z({"k1": NOW + TTL}),
    }
    env.seed(given)
    key_end = env.key(DEDUP_INDEX) + "\tm1\tk1"

    # nothing of the delivery is written, however often it is sent
    assert env.settle(outcome, run_header=header_of(ended()), run=ended(), dedup=key_end) == 2
    assert env.settle(outcome, run_header=header_of(ended()), run=ended(), dedup=key_end) == 2
    env.assert_state(given)

    # and once the key moved on to the follow-up, the delivery settles as any other
    env.client.hset(env.key(RECORD), mapping={"id": "m7", "state": "queued"})
    assert env.settle(outcome) == 1
    assert not env.client.sismember(env.key(ACKS), "r1")


# A delivery left for its key's follow-up that maintenance recovered meanwhile is taken back
# (its waiting copy out of the queue or the suspects list, r1 in w1's ack set again), so no
# claim runs the copy while the key is handed over; one whose copy w2 took is settled as usual
# (reply 0), its record left to w2's run of the copy.
@pytest.mark.parametrize(
    ("given", "waits_in"),
    [
        pytest.param({LIST: ["r0", "r1"], MSGS: {"r0": "b0", "r1": "b1"}}, LIST, id="queue"),
        pytest.param({SUSPECTS: ["r2", "r1"], MSGS: {"r1": "b1"}}, SUSPECTS, id="suspects"),
    ],
)
def test_settle_takes_back_a_recovered_delivery_left_for_a_follow_up(
    env: Env, given: State, waits_in: str
) -> None:
    follow_up = {"id": "m1", "state": "running", **FOLLOW_UP}
    env.seed({**given, INFLIGHT: {"r1": entry(1)}, RECORD: follow_up})
    key_end = env.key(DEDUP_INDEX) + "\tm1\tk1"

    assert env.settle("completed", dedup=key_end) == 2

    assert b"r1" not in env.client.lrange(env.key(waits_in), 0, -1)
    assert env.client.sismember(env.key(ACKS), "r1")
    assert text(env.client.hgetall(env.key(RECORD))) == follow_up
    assert not env.client.exists(env.key(DONE_M1))
    # the key handed over, the delivery settles as its worker's
    env.client.hset(env.key(RECORD), mapping={"id": "m7", "state": "queued"})
    assert env.settle("completed") == 1


def test_settle_leaves_the_key_of_a_delivery_whose_copy_another_worker_took(env: Env) -> None:
    follow_up = {"id": "m1", "state": "running", **FOLLOW_UP}
    env.seed({**TAKEN_BY_W2, RECORD: follow_up})
    key_end = env.key(DEDUP_INDEX) + "\tm1\tk1"

    assert env.settle("completed", dedup=key_end) == 0

    assert text(env.client.hgetall(env.key(RECORD))) == follow_up
    assert env.client.sismember(env.key(ACKS_W2), "r1")


def test_settle_retry_sent_twice_enqueues_once(env: Env) -> None:
    # Given: r1 claimed by w1
    env.seed({MSGS: {"r1": "b1"}, ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}})

    # When: the same settle is sent twice (a command re-sent after a dropped connection)
    first = env.settle("retry", retry=(QUEUE, "r3", "retry"))
    second = env.settle("retry", retry=(QUEUE, "r3", "retry"))

    # Then: the retry is there once (its bell holds one token)
    assert (first, second) == (1, 0)
    env.assert_state({LIST: ["r3"], MSGS: {"r3": "retry"}, BELL: ["1"]})


@pytest.mark.parametrize(
    ("outcome", "marker_ttl", "run_header"),
    [
        pytest.param("completed", 0, "", id="completed-marker-ttl-0"),
        pytest.param("completed", 2**48 + 1, "", id="completed-marker-ttl-beyond-2-48"),
        pytest.param(
            "ack",
            TTL,
            header().replace(str(COMPLETED_TTL), "0"),
            id="completed-record-ttl-0",
        ),
        pytest.param(
            "ack",
            TTL,
            header().replace(str(FAILED_TTL), "-5"),
            id="failed-record-ttl-negative-header-unreadable",
        ),
    ],
)
def test_settle_refuses_a_bad_ttl_before_writing(
    env: Env, outcome: str, marker_ttl: int, run_header: str
) -> None:
    given: State = {MSGS: {"r1": kumiko_message("m1")}, ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}}
    env.seed(given)

    with pytest.raises(redis.ResponseError, match="TTL must be an integer"):
        env.settle(outcome, marker_ttl=marker_ttl, run_header=run_header, run=ended())

    env.assert_state(given)


# settle and the run history: the record (ARGV[6], its header ARGV[5]) is written on every
# outcome, owned or not; a delivery still this worker's adds "n" = the deliveries of its
# entry when more than one (another worker's entry is left as it was, unread); its hash
# lives its status TTL (at least the failed TTL after the first attempt), its tenant and
# origin indexes the longer TTL; a "dead" outcome that moves the message also writes the
# dead letter's note (ARGV[7], kept as long as dead letters). Status "" (a sequential
# hand-off) writes no record; "malformed" reads the record off the body.
SETTLE_M1: State = {MSGS: {"r1": kumiko_message("m1")}, ACKS: {"r1"}, INFLIGHT: {"r1": entry(1)}}
DEAD_M1 = ended(status="dead", et="ValueError", em="boom", tb="Traceback ...")
#: The dead letter's note as history.end_record writes it (Python's json.dumps).
DEAD_NOTE_M1 = J(
    {
        "r": "r1",
        "q": QUEUE,
        "j": JOB,
        "m": "m1",
        "o": "m1",
        "t": None,
        "a": 1,
        "ma": 3,
        "et": "ValueError",
        "em": "boom",
        "tb": "Traceback ...",
        "at": NOW,
    }
)
TENANT_RUN = ended(job=TENANT_JOB, max_attempts=2, t="acme", o="o1")
#: What settle writes for a message dead-lettered unrun (malformed): its record read off the
#: message, the reason from ARGV[6].
MALFORMED_M1 = record(
    "m1",
    1,
    "dead",
    q=ENQUEUED_AT,
    w=RUN_WORKER,
    en=NOW,
    et="MalformedMessage",
    em="no such actor",
    n=2,
)
#: The entry of w2, which took r1 over: its third delivery (w1's settle must not count it).
W2_ENTRY = entry(3, NOW - 1_000, OTHER_RUN_WORKER)


@pytest.mark.parametrize(
    ("given", "outcome", "run_header", "run", "note", "retry", "reply", "after", "expiry"),
    [
        pytest.param(
            SETTLE_M1,
            "completed",
            header_of(ended()),
            ended(),
            "",
            None,
            1,
            {DONE_M1: "1", **indexed(ended(), NOW)},
            {DONE_M1: TTL, run_hash("m1"): COMPLETED_TTL},
            id="completed-record-indexed-with-the-completed-ttl",
        ),
        pytest.param(
            SETTLE_M1,
            "retry",
            header_of(FAILED_M1),
            FAILED_M1,
            "",
            (DQ, "r3", "retry"),
            1,
            {
                DQ_LIST: ["r3"],
                DQ_MSGS: {"r3": "retry"},
                DQ_BELL: ["1"],
                **indexed(FAILED_M1, NOW),
            },
            {run_hash("m1"): FAILED_TTL, DQ_BELL: BELL_TTL},
            id="failed-record-with-the-failed-ttl-and-the-retry-enqueued",
        ),
        pytest.param(
            {**SETTLE_M1, INFLIGHT: {"r1": entry(3)}},
            "completed",
            header_of(ended()),
            ended(),
            "",
            None,
            1,
            {DONE_M1: "1", **indexed(ended(n=3), NOW)},
            {DONE_M1: TTL, run_hash("m1"): COMPLETED_TTL},
            id="a-redelivered-attempts-record-counts-its-deliveries",
        ),
        pytest.param(
            {**SETTLE_M1, **indexed(FAILED_M1, NOW - 60_000)},
            "completed",
            header_of(SECOND_ATTEMPT),
            SECOND_ATTEMPT,
            "",
            None,
            1,
            {DONE_M1: "1", **merge(indexed(FAILED_M1, NOW - 60_000), indexed(SECOND_ATTEMPT, NOW))},
            {DONE_M1: TTL, run_hash("m1"): FAILED_TTL},
            id="a-second-attempt-keeps-the-failed-ttl-of-the-first",
        ),
        pytest.param(
            {**SETTLE_M1, **indexed(FAILED_M1, NOW - 60_000)},
            "completed",
            header_of(ended()),
            ended(),
            "",
            None,
            1,
            {DONE_M1: "1", **indexed(ended(), NOW)},
            {DONE_M1: TTL, run_hash("m1"): COMPLETED_TTL},
            id="an-attempt-written-again-leaves-its-old-status-indexes",
        ),
        pytest.param(
            SETTLE_M1,
            "dead",
            header_of(DEAD_M1),
            DEAD_M1,
            DEAD_NOTE_M1,
            None,
            1,
            {
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": kumiko_message("m1")},
                dead_note("m1"): DEAD_NOTE_M1,
                **indexed(DEAD_M1, NOW),
            },
            {run_hash("m1"): FAILED_TTL, dead_note("m1"): DEAD_TTL},
            id="dead-owned-dead-letter-with-its-note-and-record",
        ),
        pytest.param(
            {MSGS: {"r1": kumiko_message("m1")}, ACKS_W2: {"r1"}, INFLIGHT: {"r1": entry(1)}},
            "dead",
            header_of(DEAD_M1),
            DEAD_M1,
            DEAD_NOTE_M1,
            None,
            0,
            {
                MSGS: {"r1": kumiko_message("m1")},
                ACKS_W2: {"r1"},
                INFLIGHT: {"r1": entry(1)},
                **indexed(DEAD_M1, NOW),
            },
            {run_hash("m1"): FAILED_TTL},
            id="dead-not-owned-record-written-but-no-dead-letter-and-no-note",
        ),
        pytest.param(
            {MSGS: {"r1": kumiko_message("m1")}, ACKS_W2: {"r1"}, INFLIGHT: {"r1": W2_ENTRY}},
            "completed",
            header_of(ended()),
            ended(),
            "",
            None,
            0,
            {
                MSGS: {"r1": kumiko_message("m1")},
                ACKS_W2: {"r1"},
                INFLIGHT: {"r1": W2_ENTRY},
                DONE_M1: "1",
                **indexed(ended(), NOW),
            },
            {DONE_M1: TTL, run_hash("m1"): COMPLETED_TTL},
            id="not-owned-the-other-workers-entry-keeps-its-count-the-record-gets-no-n",
        ),
        pytest.param(
            SETTLE_M1,
            "completed",
            header_of(TENANT_RUN),
            TENANT_RUN,
            "",
            None,
            1,
            {DONE_M1: "1", **indexed(TENANT_RUN, NOW)},
            {
                DONE_M1: TTL,
                run_hash("m1"): COMPLETED_TTL,
                by_tenant("acme"): INDEX_TTL,
                by_origin("o1"): INDEX_TTL,
            },
            id="tenant-and-origin-indexes-live-the-longer-ttl",
        ),
        pytest.param(
            SETTLE_M1,
            "retry",
            header(status=""),
            "",
            "",
            (DQ, "r3", "handoff"),
            1,
            {DQ_LIST: ["r3"], DQ_MSGS: {"r3": "handoff"}, DQ_BELL: ["1"]},
            {DQ_BELL: BELL_TTL},
            id="a-hand-off-enqueues-its-message-and-writes-no-record",
        ),
        pytest.param(
            {**SETTLE_M1, MSGS: {"r1": "not json {"}},
            "dead",
            header("r1", 0, "", "malformed", "", ""),
            "it does not decode",
            "",
            None,
            1,
            {XQ: Z({"r1": NOW}), XQ_MSGS: {"r1": "not json {"}},
            {},
            id="malformed-not-kumikos-dead-lettered-without-a-record",
        ),
        pytest.param(
            {**SETTLE_M1, INFLIGHT: {"r1": entry(2)}},
            "dead",
            header("r1", 0, "", "malformed", "", ""),
            "no such actor",
            "",
            None,
            1,
            {
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": kumiko_message("m1")},
                **indexed(MALFORMED_M1, ENQUEUED_AT),
            },
            {run_hash("m1"): FAILED_TTL},
            id="malformed-kumikos-record-says-dead-names-the-in-flight-worker",
        ),
    ],
)
def test_settle_writes_the_run_record(
    env: Env,
    given: State,
    outcome: str,
    run_header: str,
    run: J | str,
    note: J | str,
    retry: tuple[str, str, str] | None,
    reply: int,
    after: State,
    expiry: dict[str, int],
) -> None:
    env.seed(given)

    assert env.settle(outcome, run_header=run_header, run=run, note=note, retry=retry) == reply

    env.assert_state(after)
    env.assert_expiry(expiry)


# A settle whose caller vouches for the record's job and status indexes (it refreshed their
# TTLs less than a minute ago) leaves their TTLs as they are; one that does not (or says
# nothing) refreshes them to the longest record age plus the slack. A tenant's index is
# refreshed either way: the broker vouches for the job's and the status's only.
@pytest.mark.parametrize("vouched", [True, False, None])
def test_settle_refreshes_the_index_ttls_it_is_not_vouched_for(
    env: Env, vouched: bool | None
) -> None:
    run = ended(t="acme")
    env.seed({**SETTLE_M1, **indexed(RECENT_COMPLETED, NOW - 5_000)})
    for index in (by_job("completed"), by_status("completed")):
        env.client.pexpire(env.key(index), 60_000)

    assert env.settle("completed", run_header=header_of(run), run=run, vouched=vouched) == 1

    env.assert_state(
        {DONE_M1: "1", **merge(indexed(RECENT_COMPLETED, NOW - 5_000), indexed(run, NOW))}
    )
    kept = {by_job("completed"): 60_000, by_status("completed"): 60_000} if vouched else {}
    env.assert_expiry({DONE_M1: TTL, run_hash("m1"): COMPLETED_TTL, run_hash("c2"): NO_TTL, **kept})


# A settle with a trim budget trims after its write: entries older than their status age
# leave the status indexes and its job's (a hand-off names no job), then the oldest records
# beyond the cap go (trim_runs, see test_trim_runs).
OLD_COMPLETED = ended("c1")
RECENT_COMPLETED = ended("c2")


@pytest.mark.parametrize(
    ("given", "run_header", "run", "after"),
    [
        pytest.param(
            indexed(RECENT_COMPLETED, NOW - 5_000),
            header_of(ended(), cap=1, trim=32),
            ended(),
            indexed(ended(), NOW),
            id="beyond-the-cap-the-oldest-record-goes",
        ),
        pytest.param(
            indexed(RECENT_COMPLETED, NOW - 5_000),
            header_of(ended(), cap=1, trim=0),
            ended(),
            merge(indexed(RECENT_COMPLETED, NOW - 5_000), indexed(ended(), NOW)),
            id="no-budget-no-trim",
        ),
        pytest.param(
            indexed(OLD_COMPLETED, PAST_COMPLETED_AGE),
            header(status="", trim=4),
            "",
            {
                run_hash("c1"): {"1": OLD_COMPLETED},
                by_job("completed"): Z({"c1:1": PAST_COMPLETED_AGE}),
            },
            id="a-hand-off-ages-out-the-status-indexes-only",
        ),
    ],
)
def test_settle_trims_the_run_history(
    env: Env, given: State, run_header: str, run: J | str, after: State
) -> None:
    env.seed({**SETTLE_M1, **given})

    assert env.settle("ack", run_header=run_header, run=run) == 1

    env.assert_state(after)


# settle of a delivery maintenance recovered (w1 was presumed dead and its ack set went
# back to the queue): while the recovered copy still waits, in the queue (behind r0) or in the
# suspects list (behind the suspect r2), settle takes the copy back and settles the delivery
# as if w1 still held it (reply 1), so no second copy of a settled message is left to run;
# once another worker (w2) took the copy, nothing but the marker ("completed") and the record
# is written (reply 0), r1's entry (w2's now) left as it was and uncounted in the record: the
# copy runs there, at least once. Each row's "after" lists what the outcome leaves besides its
# run record and r2's entry, which every row adds (r1's entry, when left, is in "after").
#: m1's end record with status "cancelled", as an ack writes it (unlike CANCELLED_M1, the
#: record cancel writes for a message that never started).
ENDED_CANCELLED_M1 = ended(status="cancelled")
#: outcome -> the run record its settle writes, and that record's TTL
OUTCOME_RUNS: dict[str, tuple[J, int]] = {
    "ack": (ENDED_CANCELLED_M1, COMPLETED_TTL),
    "completed": (ended(), COMPLETED_TTL),
    "retry": (FAILED_M1, FAILED_TTL),
    "dead": (DEAD_M1, FAILED_TTL),
}
RECOVERED_TO_QUEUE: State = {
    LIST: ["r0", "r1"],
    MSGS: {"r0": "b0", "r1": "b1"},
    INFLIGHT: {"r1": entry(1), **R2_ENTRY},
}
RECOVERED_TO_SUSPECTS: State = {
    SUSPECTS: ["r2", "r1"],
    MSGS: {"r1": "b1", "r2": "b2"},
    INFLIGHT: {"r1": entry(1), **R2_ENTRY},
}
#: w2 fetched the recovered copy: its entry says so (a second delivery, by w2's process)
TAKEN_BY_W2: State = {
    MSGS: {"r1": "b1"},
    ACKS_W2: {"r1"},
    INFLIGHT: {"r1": entry(2, NOW - 1_000, OTHER_RUN_WORKER), **R2_ENTRY},
}
#: what settle leaves of it: all of it (w2's claim, its entry and the message)
TAKEN_LEFT: State = TAKEN_BY_W2


@pytest.mark.parametrize(
    ("given", "outcome", "retry_queue", "reply", "after", "expiry"),
    [
        pytest.param(
            RECOVERED_TO_QUEUE,
            "ack",
            None,
            1,
            {LIST: ["r0"], MSGS: {"r0": "b0"}},
            {},
            id="in-the-queue-ack-takes-the-copy-back",
        ),
        pytest.param(
            RECOVERED_TO_QUEUE,
            "completed",
            None,
            1,
            {LIST: ["r0"], MSGS: {"r0": "b0"}, DONE_M1: "1"},
            {DONE_M1: TTL},
            id="in-the-queue-completed-takes-the-copy-back-and-marks",
        ),
        pytest.param(
            RECOVERED_TO_QUEUE,
            "retry",
            QUEUE,
            1,
            {LIST: ["r0", "r3"], MSGS: {"r0": "b0", "r3": "retry"}, BELL: ["1"]},
            {BELL: BELL_TTL},
            id="in-the-queue-retry-replaces-the-copy-by-the-retry",
        ),
        pytest.param(
            RECOVERED_TO_QUEUE,
            "dead",
            None,
            1,
            {
                LIST: ["r0"],
                MSGS: {"r0": "b0"},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
                dead_note("m1"): DEAD_NOTE_M1,
            },
            {dead_note("m1"): DEAD_TTL},
            id="in-the-queue-dead-dead-letters-the-copy-with-its-note",
        ),
        pytest.param(
            RECOVERED_TO_SUSPECTS,
            "ack",
            None,
            1,
            {SUSPECTS: ["r2"], MSGS: {"r2": "b2"}},
            {},
            id="a-suspect-ack-takes-the-copy-back",
        ),
        pytest.param(
            RECOVERED_TO_SUSPECTS,
            "completed",
            None,
            1,
            {SUSPECTS: ["r2"], MSGS: {"r2": "b2"}, DONE_M1: "1"},
            {DONE_M1: TTL},
            id="a-suspect-completed-takes-the-copy-back-and-marks",
        ),
        pytest.param(
            RECOVERED_TO_SUSPECTS,
            "retry",
            DQ,
            1,
            {
                SUSPECTS: ["r2"],
                MSGS: {"r2": "b2"},
                DQ_LIST: ["r3"],
                DQ_MSGS: {"r3": "retry"},
                DQ_BELL: ["1"],
            },
            {DQ_BELL: BELL_TTL},
            id="a-suspect-retry-takes-the-copy-back-and-delays-the-retry",
        ),
        pytest.param(
            RECOVERED_TO_SUSPECTS,
            "dead",
            None,
            1,
            {
                SUSPECTS: ["r2"],
                MSGS: {"r2": "b2"},
                XQ: Z({"r1": NOW}),
                XQ_MSGS: {"r1": "b1"},
                dead_note("m1"): DEAD_NOTE_M1,
            },
            {dead_note("m1"): DEAD_TTL},
            id="a-suspect-dead-dead-letters-the-copy-with-its-note",
        ),
        pytest.param(
            TAKEN_BY_W2,
            "ack",
            None,
            0,
            TAKEN_LEFT,
            {},
            id="taken-by-another-worker-ack-writes-the-record-only",
        ),
        pytest.param(
            TAKEN_BY_W2,
            "completed",
            None,
            0,
            {**TAKEN_LEFT, DONE_M1: "1"},
            {DONE_M1: TTL},
            id="taken-by-another-worker-completed-writes-the-marker-and-record-only",
        ),
        pytest.param(
            TAKEN_BY_W2,
            "retry",
            QUEUE,
            0,
            TAKEN_LEFT,
            {},
            id="taken-by-another-worker-retry-enqueues-nothing",
        ),
        pytest.param(
            TAKEN_BY_W2,
            "dead",
            None,
            0,
            TAKEN_LEFT,
            {},
            id="taken-by-another-worker-dead-moves-nothing-and-writes-no-note",
        ),
    ],
)
def test_settle_of_a_delivery_recovered_by_maintenance(
    env: Env,
    given: State,
    outcome: str,
    retry_queue: str | None,
    reply: int,
    after: State,
    expiry: dict[str, int],
) -> None:
    env.seed(given)
    run, run_ttl = OUTCOME_RUNS[outcome]
    # no "n": a recovered copy's entry counts 1 delivery, and w2's entry is not w1's to count
    note = DEAD_NOTE_M1 if outcome == "dead" else ""
    retry = None if retry_queue is None else (retry_queue, "r3", "retry")

    assert env.settle(outcome, run_header=header_of(run), run=run, note=note, retry=retry) == reply

    env.assert_state({INFLIGHT: R2_ENTRY, **after, **indexed(run, NOW)})
    env.assert_expiry({**expiry, run_hash("m1"): run_ttl})
    assert env.heartbeat("w1") == NOW


# The follow-up (a retry or a hand-off) is settle's first write: when it fails (here the
# delay queue's message hash is not a hash), the script stops before anything else is
# written, so the delivery stays as it was: its claim, its entry, its message (or its
# recovered copy), no record; the worker's next attempt (or the copy) still runs it.
WRONG_TYPED_DQ: State = {DQ_MSGS: "not a hash"}


@pytest.mark.parametrize(
    "given",
    [
        pytest.param(SETTLE_OWNED, id="owned"),
        pytest.param(RECOVERED_TO_QUEUE, id="recovered-to-the-queue"),
        pytest.param(RECOVERED_TO_SUSPECTS, id="recovered-to-the-suspects"),
    ],
)
def test_settle_writes_the_follow_up_first(env: Env, given: State) -> None:
    env.seed({**given, **WRONG_TYPED_DQ})

    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        env.settle(
            "retry", run_header=header_of(FAILED_M1), run=FAILED_M1, retry=(DQ, "r3", "retry")
        )

    env.assert_state({**given, **WRONG_TYPED_DQ})


@pytest.mark.parametrize(
    ("given", "queue", "reply", "after"),
    [
        pytest.param(
            {MSGS: {"r1": "b1", "r2": "b2"}, ACKS: {"r1", "r2"}},
            QUEUE,
            1,
            {MSGS: {"r2": "b2"}, ACKS: {"r2"}, XQ: Z({"r1": NOW}), XQ_MSGS: {"r1": "b1"}},
            id="owned-with-body-dead-letters",
        ),
        pytest.param(
            {ACKS: {"r1"}},
            QUEUE,
            0,
            {},
            id="owned-without-body-drops-the-claim",
        ),
        pytest.param(
            {MSGS: {"r1": "b1"}, ACKS_W2: {"r1"}},
            QUEUE,
            0,
            {MSGS: {"r1": "b1"}, ACKS_W2: {"r1"}},
            id="not-owned",
        ),
        pytest.param(
            {DQ_MSGS: {"r1": "b1"}, DQ_ACKS: {"r1"}},
            DQ,
            1,
            {XQ: Z({"r1": NOW}), XQ_MSGS: {"r1": "b1"}},
            id="delay-queue-dead-letters-into-canonical-xq",
        ),
    ],
)
def test_nack(env: Env, given: State, queue: str, reply: int, after: State) -> None:
    env.seed(given)

    assert env.lua.nack(keys=[NAMESPACE], args=[*env.head(queue), "r1"]) == reply

    env.assert_state(after)
    assert env.heartbeat("w1") == NOW


def test_nack_scores_the_dead_letter_by_a_real_millisecond_clock(env: Env) -> None:
    # Given: a 13-digit "now", as the broker passes it (Lua numbers must keep every digit)
    now = 1_796_080_435_717
    env.seed({MSGS: {"r1": "b1"}, ACKS: {"r1"}})

    assert env.lua.nack(keys=[NAMESPACE], args=[*env.head(now=now), "r1"]) == 1

    env.assert_state({XQ: Z({"r1": now}), XQ_MSGS: {"r1": "b1"}})
    assert env.heartbeat("w1") == now


# The end of a job that keeps results: a completed run's value is set at root .. "result:"
# .. origin for its TTL and the origin id is published on root .. "results", with its job and
# value when the value is at most 8 KiB; a dead end ("-") publishes the id alone; a job that
# keeps none ("") writes and publishes nothing.
@pytest.mark.parametrize(
    ("kept", "value", "announced"),
    [
        pytest.param(
            '600000 {"v":[1,2]}',
            '{"v":[1,2]}',
            b'm1\tapp:job:sync\t{"v":[1,2]}',
            id="completed-value-kept-and-announced-with-it",
        ),
        pytest.param(
            "600000 " + '"' + "x" * 8200 + '"',
            '"' + "x" * 8200 + '"',
            b"m1",
            id="a-value-over-8-KiB-announced-without-it",
        ),
        pytest.param("-", None, b"m1", id="dead-end-announced-without-a-value"),
        pytest.param("", None, None, id="no-result-kept"),
    ],
)
def test_settle_keeps_the_result_and_announces_the_end(
    env: Env, kept: str, value: str | None, announced: bytes | None
) -> None:
    env.seed(SETTLE_M1)
    pubsub = env.client.pubsub(ignore_subscribe_messages=True)
    channel = env.key(ROOT) + "results"
    pubsub.subscribe(channel)
    assert pubsub.get_message(timeout=5) is None  # the confirmation, ignored

    run = ended()
    assert env.settle("completed", run_header=header_of(run), run=run, result=kept) == 1

    result_key = env.key(ROOT) + "result:m1"
    assert env.client.get(result_key) == (None if value is None else value.encode())
    if value is not None:
        assert 0 < env.client.pttl(result_key) <= 600_000
    message = pubsub.get_message(timeout=2 if announced else 0.2)
    assert (None if message is None else message["data"]) == announced
    pubsub.close()


def open_batch(env: Env, children: list[str], on_complete: str = "") -> str:
    """A batch "b1" opened with ``children`` (moved onto no queue: the settles under test
    count their ends), as lua/batch_write.lua and lua/batch_commit.lua leave it."""
    key = env.key(ROOT) + "batch:b1"
    env.client.hset(
        key,
        mapping={
            "kind": "batch",
            "state": "running",
            "total": len(children),
            "pending": len(children),
            "completed": 0,
            "dead": 0,
            "cancelled": 0,
            "ns": NAMESPACE,
            "ttl": 600_000,
            "created": NOW,
            **({"on_complete": on_complete} if on_complete else {}),
        },
    )
    env.client.rpush(key + ":children", *children)
    return key


def test_a_batch_child_settled_twice_is_counted_once(env: Env) -> None:
    # Given a batch of two children, the first of which is settled (completed)
    key = open_batch(env, ["m1", "m2"])
    env.seed(SETTLE_M1)
    run = ended()
    assert (
        env.settle("completed", run_header=header_of(run), run=run, result="0 7", batch="b b1") == 1
    )
    assert env.client.hmget(key, "pending", "completed") == [b"1", b"1"]

    # When the same child is settled again (a second copy of it ran: a redelivery, a
    # fail-over that lost the first settle's ack)
    env.seed(SETTLE_M1)
    env.settle("completed", run_header=header_of(run), run=run, result="0 7", batch="b b1")

    # Then it still counts once, with the value of its first end
    assert env.client.hmget(key, "pending", "completed", "state") == [b"1", b"1", b"running"]
    assert env.client.hget(key + ":ended", "m1") == b'{"s":"completed","j":"app:job:sync"}\n7'


def test_the_last_child_s_end_enqueues_on_complete_once_and_ends_the_batch(env: Env) -> None:
    callback = kumiko_message("cb1")
    key = open_batch(env, ["m1"], on_complete=f"{env.key('{q}')}\tr9\t{callback}")
    env.seed(SETTLE_M1)
    run = ended(status="dead", et="ValueError", em="boom")
    env.settle("dead", run_header=header_of(run), run=run, batch="b b1")

    assert env.client.hmget(key, "state", "dead", "pending", "callbacks") == [
        b"failed",
        b"1",
        b"0",
        b"1",
    ]
    end = env.client.hget(key + ":ended", "m1")
    assert isinstance(end, bytes)
    head, value = end.split(b"\n")
    assert json.loads(head) == {"s": "dead", "j": "app:job:sync", "et": "ValueError", "em": "boom"}
    assert value == b"null"
    queue = NAMESPACE + ":" + env.key("{q}")
    assert env.client.lrange(queue, 0, -1).count(b"r9") == 1
    assert env.client.hget(queue + ".msgs", "r9") == callback.encode()
    assert env.client.hget(env.key(ROOT) + "batch-outcomes", "failed") == b"1"
