"""The seam to Dramatiq: kumiko's broker commands write exactly what Dramatiq's own write.

Each scenario runs the same command sequence twice on the same keys: once through
Dramatiq's ``RedisBroker`` (its own ``dispatch.lua``), once through ``KumikoBroker``
(kumiko's Lua), and compares every reply and the whole Redis state after every step. A
Dramatiq release that changes its Redis layout or a command's semantics fails here, not in
production; see docs/upgrading.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.message import Message

from kumiko_dramatiq.broker.broker import MAINTENANCE_SCALE, KumikoBroker

Step = Callable[[Any], Any]
WORKER = "layout-w1"
DEAD_WORKER = "layout-w0"


def plain_broker(client: redis.Redis) -> RedisBroker:
    broker = RedisBroker(client=client, maintenance_chance=0)  # type: ignore[no-untyped-call]
    broker.broker_id = WORKER
    return broker


def kumiko_broker(client: redis.Redis, prefix: str) -> KumikoBroker:
    broker = KumikoBroker(
        client=client,
        middleware=[],
        heartbeat_timeout=60_000,
        maintenance_chance=0,
        dead_message_ttl=7 * 86_400_000,
        queue_prefix=prefix,
        completed_ttl_ms=60_000,
    )
    broker.broker_id = WORKER
    return broker


def snapshot(client: redis.Redis, prefix: str) -> dict[str, Any]:
    """Every Dramatiq key of the test's queues, by type; timestamps reduced to presence.

    kumiko's doorbells (``<queue>:bell``, its own keys beside the layout) are left out, each
    checked to hold at most one token with a TTL, and so are its per-job counts
    (``<queue>:counts``), checked to be ready (they start at a queue's first body)."""
    state: dict[str, Any] = {}
    patterns = (f"dramatiq:{prefix}-*", f"dramatiq:__acks__.*.{prefix}-*")
    for pattern in patterns:
        for raw_key in client.scan_iter(match=pattern, count=1000):
            key = _text(raw_key)
            if key.endswith(":bell"):
                assert client.lrange(key, 0, -1) == [b"1"], key
                assert 0 < client.pttl(key) <= 60_000, key
                continue
            if key.endswith(":counts"):
                assert client.hget(key, "~mode") == b"r", key
                continue
            kind = _text(client.type(key))
            if kind == "list":
                state[key] = ("list", client.lrange(key, 0, -1))
            elif kind == "hash":
                state[key] = ("hash", client.hgetall(key))
            elif kind == "set":
                state[key] = ("set", sorted(client.smembers(key)))
            elif kind == "zset":
                state[key] = ("zset", sorted(client.zrange(key, 0, -1)))
            else:
                state[key] = (kind,)
    beats = {_text(member) for member in client.zrange("dramatiq:__heartbeats__", 0, -1)}
    state["heartbeats"] = sorted(beats & {WORKER, DEAD_WORKER})
    return state


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def run(client: redis.Redis, prefix: str, broker: Any, steps: list[Step]) -> list[Any]:
    """Replies and states after each step, starting from nothing."""
    clean(client, prefix)
    trace = []
    for step in steps:
        reply = step(broker)
        trace.append((reply, snapshot(client, prefix)))
    clean(client, prefix)
    return trace


def clean(client: redis.Redis, prefix: str) -> None:
    for pattern in (f"dramatiq:{prefix}-*", f"dramatiq:__acks__.*.{prefix}-*"):
        keys = list(client.scan_iter(match=pattern, count=1000))
        if keys:
            client.delete(*keys)
    client.zrem("dramatiq:__heartbeats__", WORKER, DEAD_WORKER)


@pytest.fixture
def compare(redis_client: redis.Redis, prefix: str) -> Iterator[Callable[[list[Step]], None]]:
    def check(steps: list[Step]) -> None:
        expected = run(redis_client, prefix, plain_broker(redis_client), steps)
        actual = run(redis_client, prefix, kumiko_broker(redis_client, prefix), steps)
        for number, (want, got) in enumerate(zip(expected, actual, strict=True), start=1):
            assert got == want, f"step {number} differs"

    yield check
    clean(redis_client, prefix)


def test_enqueue_fetch_ack_nack_write_what_dramatiq_writes(
    compare: Callable[[list[Step]], None], prefix: str
) -> None:
    q, dq = f"{prefix}-layout", f"{prefix}-layout.DQ"
    compare(
        [
            lambda b: b.do_enqueue(q, "m1", b"body-1"),
            lambda b: b.do_enqueue(q, "m2", b"body-2"),
            lambda b: b.do_enqueue(q, "m3", b"body-3"),
            lambda b: b.do_enqueue(dq, "d1", b"delayed-1"),
            lambda b: b.do_fetch(q, 2),
            lambda b: b.do_ack(q, "m1"),
            lambda b: b.do_nack(q, "m2"),
            lambda b: b.do_fetch(q, 5),
            lambda b: b.do_fetch(q, 5),
            lambda b: b.do_fetch(dq, 5),
            lambda b: b.do_qsize(q),
            lambda b: b.do_qsize(dq),
            lambda b: b.do_requeue(q, "m3", "not-mine"),
            lambda b: b.do_ack(dq, "d1"),
            lambda b: b.do_nack(q, "not-mine"),
            lambda b: b.do_ack(q, "not-mine"),
        ]
    )


def test_a_message_that_vanished_is_fetched_as_none_like_dramatiq(
    compare: Callable[[list[Step]], None], redis_client: redis.Redis, prefix: str
) -> None:
    q = f"{prefix}-layout"
    compare(
        [
            lambda b: b.do_enqueue(q, "m1", b"body-1"),
            lambda b: redis_client.hdel(f"dramatiq:{q}.msgs", "m1"),
            lambda b: b.do_fetch(q, 3),
        ]
    )


def test_a_delayed_message_is_dead_lettered_on_its_canonical_queue(
    compare: Callable[[list[Step]], None], prefix: str
) -> None:
    dq = f"{prefix}-layout.DQ"
    compare(
        [
            lambda b: b.do_enqueue(dq, "d1", b"delayed-1"),
            lambda b: b.do_fetch(dq, 1),
            lambda b: b.do_nack(dq, "d1"),
        ]
    )


def test_maintenance_recovers_a_dead_workers_messages_like_dramatiq(
    compare: Callable[[list[Step]], None], redis_client: redis.Redis, prefix: str
) -> None:
    q = f"{prefix}-layout"
    dead_acks = f"dramatiq:__acks__.{DEAD_WORKER}.{q}"

    def with_maintenance(broker: Any) -> Any:
        broker.maintenance_chance = MAINTENANCE_SCALE
        broker.dead_message_ttl = 0
        try:
            return broker.do_qsize(q)
        finally:
            broker.maintenance_chance = 0

    compare(
        [
            lambda b: b.do_enqueue(q, "m1", b"body-1"),
            lambda b: b.do_enqueue(q, "m2", b"body-2"),
            lambda b: b.do_fetch(q, 2),
            lambda b: b.do_nack(q, "m2"),
            # the dead worker claimed m1 and a message that no longer exists
            lambda b: redis_client.smove(f"dramatiq:__acks__.{WORKER}.{q}", dead_acks, "m1"),
            lambda b: redis_client.sadd(dead_acks, "gone"),
            lambda b: redis_client.zadd("dramatiq:__heartbeats__", {DEAD_WORKER: 1}),
            with_maintenance,
        ]
    )


def test_purge_and_flush_drop_what_dramatiq_drops(
    compare: Callable[[list[Step]], None], prefix: str
) -> None:
    q = f"{prefix}-layout"
    compare(
        [
            lambda b: b.do_enqueue(q, "m1", b"body-1"),
            lambda b: b.do_enqueue(q, "m2", b"body-2"),
            lambda b: b.do_fetch(q, 1),
            lambda b: b.do_nack(q, "m1"),
            lambda b: b.do_purge(q),
        ]
    )


def test_messages_of_either_broker_are_consumed_by_the_other(
    redis_client: redis.Redis, prefix: str
) -> None:
    # Given a message enqueued by Dramatiq's broker and one by kumiko's
    q = f"{prefix}-layout"
    plain, kumiko = plain_broker(redis_client), kumiko_broker(redis_client, prefix)
    plain.do_enqueue(q, "from-dramatiq", b"a")
    kumiko.do_enqueue(q, "from-kumiko", b"b")
    try:
        # When each broker fetches one and acks it
        assert kumiko.do_fetch(q, 1) == [b"a"]
        assert plain.do_fetch(q, 1) == [b"b"]
        kumiko.do_ack(q, "from-dramatiq")
        plain.do_ack(q, "from-kumiko")
        # Then nothing is left
        assert plain.do_qsize(q) == kumiko.do_qsize(q) == 0
    finally:
        clean(redis_client, prefix)


def test_a_delayed_enqueue_waits_on_the_schedule_not_on_the_delay_queue_list(
    redis_client: redis.Redis, prefix: str
) -> None:
    """The one intended difference of the layout (docs/upgrading.md): a delayed message
    waits on kumiko's schedule (``<queue>.DQ:schedule``, by due time), its body in the delay
    queue's hash in the form it takes on its queue, not on Dramatiq's ``.DQ`` list; the
    message middleware sees, Dramatiq's ``qsize`` and ``flush`` are the same."""
    q = f"{prefix}-layout"
    message: Message[Any] = Message(
        queue_name=q, actor_name="act", args=(1,), kwargs={}, options={}
    )
    # Dramatiq: the id on the .DQ list, the body with its eta
    plain = plain_broker(redis_client)
    clean(redis_client, prefix)
    sent = plain.enqueue(message, delay=60_000)
    plain_state = snapshot(redis_client, prefix)
    assert plain_state[f"dramatiq:{q}.DQ"] == ("list", [sent.options["redis_message_id"].encode()])
    plain_size = plain.do_qsize(q)
    clean(redis_client, prefix)
    # kumiko: the id on the schedule, no .DQ list, the body as it will wait on the queue
    ours = kumiko_broker(redis_client, prefix)
    written = ours.enqueue(message, delay=60_000)
    rid = written.options["redis_message_id"]
    state = snapshot(redis_client, prefix)
    assert f"dramatiq:{q}.DQ" not in state
    assert state[f"dramatiq:{q}.DQ:schedule"] == ("zset", [rid.encode()])
    assert set(state) == {f"dramatiq:{q}.DQ:schedule", f"dramatiq:{q}.DQ.msgs", "heartbeats"}
    stored = redis_client.hget(f"dramatiq:{q}.DQ.msgs", rid)
    assert isinstance(stored, bytes)
    body = Message.decode(stored)
    assert body.queue_name == q
    assert "eta" not in body.options
    assert (body.message_id, list(body.args)) == (message.message_id, [1])
    # what callers and middleware see is Dramatiq's delayed message
    assert written.queue_name == sent.queue_name == f"{q}.DQ"
    assert "eta" in written.options
    assert ours.do_qsize(q) == plain_size == 1
    ours.flush(q)
    assert set(snapshot(redis_client, prefix)) == {"heartbeats"}
