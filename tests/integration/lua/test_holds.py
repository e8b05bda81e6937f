"""The hold protocol's Redis side (``lua/include/holds.lua``): claims split into running and
held, starts reported, asks written, answered and taken over, held messages of a dead worker
claimed again. Each test seeds its own keys and reads back what the scripts wrote."""

from __future__ import annotations

from typing import Any

from tests.integration.lua.tables import (
    ACKS,
    ACKS_W2,
    COMPLETED_TTL,
    FAILED_TTL,
    HEARTBEATS,
    INFLIGHT,
    LIST,
    MSGS,
    NAMESPACE,
    NOW,
    QUEUE,
    ROOT,
    RUN_WORKER,
    Env,
    text,
)

ASKS_W2 = "kumiko:{p}:asks:{w2}"
BELL_W2 = "kumiko:{p}:askbell:{w2}"
ANSWER = "kumiko:{p}:answer:req1"
TTLS = f"{COMPLETED_TTL} {FAILED_TTL} 60000"


def _body(n: int) -> str:
    return (
        '{"queue_name":"q","actor_name":"a","args":[],"kwargs":{},"options":{},'
        f'"message_id":"m{n}","message_timestamp":1}}'
    )


def _fetch(env: Env, count: int, now_room: int, *hold: str, worker: str = "w1") -> Any:
    """fetch_lane with a claim of ``count``, ``now_room`` of them to run now, and a hold
    block (``hold``: its arguments; none: "0 0")."""
    return env.fetch_lane(count, run_now=now_room, hold=hold or ("0 0",), worker=worker)


def _queued(env: Env, count: int) -> None:
    rids = [f"r{n}" for n in range(count)]
    env.seed({LIST: rids, MSGS: {rid: _body(n) for n, rid in enumerate(rids)}})


def test_a_claim_enters_the_first_to_run_now_and_holds_the_rest(env: Env) -> None:
    _queued(env, 4)
    reply = _fetch(env, 3, 1)
    fetched, _, _, _, _, now, holds = reply
    assert fetched[::2] == ["r0", "r1", "r2"]
    assert now == 1
    assert holds == [[], [], []]
    entries = text(env.client.hgetall(env.key(INFLIGHT)))
    assert entries == {
        "r0": f"1|{NOW}|{RUN_WORKER}",
        "r1": f"h1|{NOW}|{RUN_WORKER}",
        "r2": f"h1|{NOW}|{RUN_WORKER}",
    }


def test_a_reported_start_makes_a_held_entry_running(env: Env) -> None:
    _queued(env, 2)
    _fetch(env, 2, 0)
    # When the worker reports r1's start (at ms 1234) in its next call
    reply = _fetch(env, 0, 0, "1 0", "r1", "1234")
    # Then its entry is running since then; r0 is still held
    assert reply[-1] == [[], [], []]
    entries = text(env.client.hgetall(env.key(INFLIGHT)))
    assert entries["r1"] == f"1|1234|{RUN_WORKER}"
    assert entries["r0"].startswith("h1|")


def test_a_start_reported_after_a_takeover_is_revoked_and_a_lapsed_check_finds_it_gone(
    env: Env,
) -> None:
    _queued(env, 2)
    _fetch(env, 2, 0)
    env.client.srem(env.key(ACKS), "r0")  # taken over by a requester meanwhile
    reply = _fetch(env, 0, 0, "1 1", "r0", "1234", "r1")
    assert reply[-1] == [["r0"], [], []]
    reply = _fetch(env, 0, 0, "0 2", "r0", "r1")
    assert reply[-1] == [[], ["r0"], []]


def _ask(env: Env, rid: str, kind: str = "cancel", request: str = "req1") -> Any:
    """An ask about ``rid`` held by w2, through hold_ask."""
    return text(
        env.lua.hold_ask(keys=[NAMESPACE], args=[env.key(ROOT), env.key(QUEUE), request, kind, rid])
    )


def _held_by_w2(env: Env) -> None:
    env.client.zadd(HEARTBEATS, {env.names["w2"]: NOW})
    _queued(env, 2)
    _fetch(env, 2, 1, worker="w2")  # r0 runs, r1 is held


def test_an_ask_about_a_held_message_reaches_its_worker_and_rings_its_keeper(env: Env) -> None:
    _held_by_w2(env)
    asked = _ask(env, "r1")
    assert asked == [env.names["w2"], "r1", "req1"]
    assert _ask(env, "r0") == ["", "r0", ""]  # running there: nobody to ask
    assert text(env.client.hgetall(env.key(ASKS_W2))) == {"r1": "req1\tcancel\t1"}
    assert env.client.llen(env.key(BELL_W2)) == 1
    # a second ask about it joins the first (one more waiter, the stronger kind)
    assert _ask(env, "r1", "probe", "req2")[2] == "req1"
    assert text(env.client.hgetall(env.key(ASKS_W2))) == {"r1": "req1\tcancel\t2"}
    # the worker's next lane call brings the ask
    reply = _fetch(env, 0, 0, worker="w2")
    assert reply[-1] == [[], [], ["r1", "req1\tcancel\t2"]]


def test_a_start_reported_while_asked_answers_started(env: Env) -> None:
    _held_by_w2(env)
    _ask(env, "r1")
    _fetch(env, 0, 0, "1 0", "r1", "1234", worker="w2")
    assert text(env.client.lrange(env.key(ANSWER), 0, -1)) == ["r1\tstarted"]
    assert env.client.exists(env.key(ASKS_W2)) == 0


def _answer(env: Env, *pairs: str) -> int:
    return int(
        env.lua.hold_answer(
            keys=[NAMESPACE], args=[*env.head(worker="w2"), env.key(ROOT), TTLS, *pairs]
        )
    )


def test_a_worker_that_dropped_a_held_message_cancels_it_and_answers(env: Env) -> None:
    _held_by_w2(env)
    _ask(env, "r1")
    assert _answer(env, "r1", "dropped") == 1
    assert text(env.client.lrange(env.key(ANSWER), 0, -1)) == ["r1\tdropped"]
    # its claim, entry and body are gone, its tombstone left, its record says cancelled
    assert env.client.sismember(env.key(ACKS_W2), "r1") == 0
    assert env.client.hexists(env.key(INFLIGHT), "r1") == 0
    assert env.client.hexists(env.key(MSGS), "r1") == 0
    assert env.client.exists(env.key("kumiko:{p}:sent:r1")) == 1
    # an answer to an ask no longer pending is skipped
    assert _answer(env, "r1", "dropped") == 0


def test_a_worker_that_dropped_a_held_message_for_a_pause_puts_it_back_first_in_line(
    env: Env,
) -> None:
    _held_by_w2(env)
    _ask(env, "r1", "back")
    _answer(env, "r1", "dropped")
    assert text(env.client.lrange(env.key(LIST), 0, -1)) == ["r1"]
    assert env.client.hexists(env.key(INFLIGHT), "r1") == 0  # its delivery undone
    assert env.client.hexists(env.key(MSGS), "r1") == 1


def _takeover(env: Env, rid: str) -> str:
    return str(
        text(
            env.lua.hold_takeover(
                keys=[NAMESPACE],
                args=[env.key(QUEUE), env.names["w2"], env.key(ROOT), "req1", rid, TTLS, NOW],
            )
        )
    )


def test_a_requester_takes_a_silent_holders_message_over(env: Env) -> None:
    _held_by_w2(env)
    _ask(env, "r1")
    _ask(env, "r1", "cancel", "req9")  # a second requester waits on the same answer
    assert _takeover(env, "r1") == "dropped"
    assert env.client.sismember(env.key(ACKS_W2), "r1") == 0
    assert env.client.hexists(env.key(MSGS), "r1") == 0
    # the other waiter gets its answer; the ask is gone: a second takeover finds it answered
    assert text(env.client.lrange(env.key(ANSWER), 0, -1)) == ["r1\tdropped"]
    assert _takeover(env, "r1") == "answered"


def test_a_takeover_of_a_message_whose_start_was_reported_answers_started(env: Env) -> None:
    _held_by_w2(env)
    _ask(env, "r1")
    env.client.hset(env.key(INFLIGHT), "r1", f"1|1234|{RUN_WORKER}")  # reported meanwhile
    assert _takeover(env, "r1") == "started"
    assert env.client.sismember(env.key(ACKS_W2), "r1") == 1


def test_a_dead_workers_held_message_is_claimed_again_as_a_queued_one_its_delivery_counted(
    env: Env,
) -> None:
    # Given a message a dead worker held (maintenance put it back on the queue)
    env.seed({LIST: ["r1"], MSGS: {"r1": _body(1)}, INFLIGHT: {"r1": "h1|5|host-b:202"}})
    # Then the next fetch claims it like any other (no suspect: it may never have started),
    # its deliveries counted
    reply = _fetch(env, 2, 2)
    assert reply[0][::2] == ["r1"]
    assert reply[4] == 0
    assert text(env.client.hget(env.key(INFLIGHT), "r1")) == f"2|{NOW}|{RUN_WORKER}"


def test_a_message_held_during_two_deaths_is_a_suspect(env: Env) -> None:
    env.seed({LIST: ["r1", "r2"], MSGS: {"r1": _body(1), "r2": _body(2)},
              INFLIGHT: {"r1": "h2|5|host-b:202"}})  # fmt: skip
    reply = _fetch(env, 2, 2)
    # a fetch that holds nothing claims the suspect alone
    assert reply[0][::2] == ["r1"]
    assert reply[4] == 1
