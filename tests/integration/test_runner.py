"""JobRunner: producer-only dispatch, bad input, lanes, isolation, lifecycle, Redis down."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from dramatiq.message import Message
from dramatiq.middleware import Retries as DramatiqRetries

from kumiko_dramatiq import (
    Feature,
    JobConfigError,
    JobContext,
    JobRunner,
    PayloadError,
    RedisUnavailableError,
    Registry,
    UnknownJobError,
)
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.broker.settling import Claim
from kumiko_dramatiq.testing import private_redis_server
from tests.conftest import Recorder, RunnerFactory, wait_for


def noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


def billing_registry(**options: Any) -> Registry:
    feature = Feature("billing")
    feature.job("send", **options)(noop)
    return Registry([feature])


def queued(client: redis.Redis, prefix: str, lane: str = "worker") -> int:
    main = client.llen(f"dramatiq:{prefix}-{lane}")
    delayed = client.zcard(f"dramatiq:{prefix}-{lane}.DQ:schedule")
    return int(main) + int(delayed)


def test_dispatch_works_on_a_runner_that_never_started(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(billing_registry())
    message_id = runner.dispatch("billing:job:send", {"invoice": 1})
    assert isinstance(message_id, str)
    assert queued(redis_client, prefix) == 1


@pytest.mark.parametrize(
    "payload", [[1], "x", 3, {"at": time}, {"n": float("inf")}, {1: 2}, {"s": {1, 2}}]
)
def test_a_bad_payload_raises_and_enqueues_nothing(
    payload: Any, make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(billing_registry())
    with pytest.raises(PayloadError, match="billing:job:send: payload"):
        runner.dispatch("billing:job:send", payload)
    assert queued(redis_client, prefix) == 0


def test_an_unknown_job_raises_and_enqueues_nothing(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(billing_registry())
    with pytest.raises(UnknownJobError, match="billing:job:nope"):
        runner.dispatch("billing:job:nope")
    assert queued(redis_client, prefix) == 0


def test_a_bad_event_payload_enqueues_none_of_its_jobs(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    from kumiko_dramatiq import Event

    feature = Feature("billing")
    feature.job("a", trigger=Event("paid"))(noop)
    feature.job("b", trigger=Event("paid"))(noop)
    runner = make_runner(Registry([feature]))
    with pytest.raises(PayloadError):
        runner.handle_event("paid", {"when": object()})
    assert queued(redis_client, prefix) == 0
    assert len(runner.handle_event("paid", {"ok": True})) == 2
    assert runner.handle_event("nobody.listens") == []


@pytest.mark.parametrize("delay_ms", [-1, 1.5, True, "10"])
def test_a_bad_delay_raises_and_enqueues_nothing(
    delay_ms: Any, make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(billing_registry())
    with pytest.raises(PayloadError, match="delay_ms"):
        runner.dispatch("billing:job:send", delay_ms=delay_ms)
    assert queued(redis_client, prefix) == 0


def test_a_delayed_dispatch_runs_after_its_delay(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    runner = make_runner(billing_registry(), **recorder.hooks())
    runner.start()
    before = time.monotonic()
    message_id = runner.dispatch("billing:job:send", delay_ms=300)
    recorder.wait_until(lambda r: bool(r.of("complete")))
    assert time.monotonic() - before >= 0.3
    assert recorder.of("complete")[0].message_id == message_id


@pytest.mark.parametrize("prefix_value", ["", "9lives", "a b", "a:b", None])
def test_queue_prefix_is_validated(prefix_value: Any) -> None:
    with pytest.raises(JobConfigError, match="queue_prefix"):
        JobRunner(billing_registry(), queue_prefix=prefix_value)


def test_construction_opens_no_connection() -> None:
    runner = JobRunner(billing_registry(), redis_url="redis://127.0.0.1:1/0")
    runner.stop()
    runner.stop()


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield server.getsockname()[1]
    server.close()


def test_start_against_a_refusing_redis_fails_fast() -> None:
    runner = JobRunner(
        billing_registry(), redis_url="redis://127.0.0.1:1/0", boot_redis_timeout_ms=500
    )
    began = time.monotonic()
    with pytest.raises(RedisUnavailableError, match=r"127\.0\.0\.1:1"):
        runner.start()
    assert time.monotonic() - began < 5
    runner.stop()


def test_start_against_a_silent_redis_does_not_hang(silent_server: int) -> None:
    runner = JobRunner(
        billing_registry(),
        redis_url=f"redis://127.0.0.1:{silent_server}/0",
        boot_redis_timeout_ms=500,
    )
    began = time.monotonic()
    with pytest.raises(RedisUnavailableError):
        runner.start()
    assert time.monotonic() - began < 5
    runner.stop()


def test_dispatch_against_an_unreachable_redis_raises(silent_server: int) -> None:
    for url in ("redis://127.0.0.1:1/0", f"redis://127.0.0.1:{silent_server}/0"):
        runner = JobRunner(billing_registry(), redis_url=url, boot_redis_timeout_ms=500)
        with pytest.raises(RedisUnavailableError, match="dispatching billing:job:send"):
            runner.dispatch("billing:job:send")
        runner.stop()


def test_dispatch_to_a_server_that_is_not_redis_raises_one_line_naming_the_url(
    not_redis_server: int,
) -> None:
    url = f"redis://127.0.0.1:{not_redis_server}/0"
    runner = JobRunner(billing_registry(), redis_url=url, boot_redis_timeout_ms=500)
    try:
        with pytest.raises(RedisUnavailableError) as raised:
            runner.dispatch("billing:job:send")
        message = str(raised.value)
        assert f"127.0.0.1:{not_redis_server}" in message
        assert "does not speak the Redis protocol" in message
        assert "dispatching billing:job:send" in message
        assert "\n" not in message
    finally:
        runner.stop()


def test_two_runners_with_different_prefixes_never_see_each_others_jobs(
    redis_url: str, redis_client: redis.Redis
) -> None:
    from tests.conftest import delete_prefix

    recorders = [Recorder(), Recorder()]
    prefixes = [f"iso_a_{time.time_ns()}", f"iso_b_{time.time_ns()}"]
    runners = [
        JobRunner(
            billing_registry(), redis_url=redis_url, queue_prefix=p, worker_threads=2, **r.hooks()
        )
        for p, r in zip(prefixes, recorders, strict=True)
    ]
    try:
        for runner in runners:
            runner.start()
        ids_a = [runners[0].dispatch("billing:job:send", {"n": n}) for n in range(5)]
        ids_b = [runners[1].dispatch("billing:job:send", {"n": n}) for n in range(3)]
        recorders[0].wait_until(lambda r: len(r.of("complete")) == 5)
        recorders[1].wait_until(lambda r: len(r.of("complete")) == 3)
        runners[0].broker.join(f"{prefixes[0]}-worker")
        runners[1].broker.join(f"{prefixes[1]}-worker")
        assert sorted(e.message_id for e in recorders[0].of("complete")) == sorted(ids_a)
        assert sorted(e.message_id for e in recorders[1].of("complete")) == sorted(ids_b)
    finally:
        for runner in runners:
            runner.stop()
        for p in prefixes:
            delete_prefix(redis_client, p)


def test_a_runner_consumes_only_its_lane(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    feature = Feature("web")
    feature.job("thumbnail", run_in="api")(noop)
    feature.job("report")(noop)
    registry = Registry([feature])
    worker_recorder, api_recorder = Recorder(), Recorder()
    worker_lane = make_runner(registry, **worker_recorder.hooks())
    worker_lane.start()
    worker_lane.dispatch("web:job:thumbnail")
    worker_lane.dispatch("web:job:report")
    worker_recorder.wait_until(lambda r: bool(r.of("complete")))
    assert queued(redis_client, prefix, "api") == 1

    api_lane = make_runner(registry, lane="api", **api_recorder.hooks())
    api_lane.start()
    api_recorder.wait_until(lambda r: bool(r.of("complete")))
    assert [e.job_name for e in worker_recorder.of("complete")] == ["web:job:report"]
    assert [e.job_name for e in api_recorder.of("complete")] == ["web:job:thumbnail"]


def test_stop_waits_for_running_handlers(make_runner: RunnerFactory, recorder: Recorder) -> None:
    entered, finished = threading.Event(), threading.Event()
    feature = Feature("slow")

    @feature.job("work")
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        entered.set()
        time.sleep(0.3)
        finished.set()

    runner = make_runner(Registry([feature]), **recorder.hooks())
    runner.start()
    runner.dispatch("slow:job:work")
    assert entered.wait(10)
    runner.stop()
    assert finished.is_set()
    runner.stop()


def test_the_context_manager_stops_the_runner(redis_url: str, prefix: str) -> None:
    with JobRunner(billing_registry(), redis_url=redis_url, queue_prefix=prefix) as runner:
        runner.start()
    assert runner._stopped


def test_a_runner_starts_only_once(make_runner: RunnerFactory) -> None:
    runner = make_runner(billing_registry())
    runner.start()
    with pytest.raises(RuntimeError, match="started already"):
        runner.start()


def test_dramatiqs_own_retries_are_refused(make_runner: RunnerFactory) -> None:
    runner = make_runner(billing_registry())
    runner.broker.add_middleware(DramatiqRetries())
    with pytest.raises(JobConfigError, match="Retries"):
        runner.start()


def test_hooks_and_context_reach_the_handler(make_runner: RunnerFactory) -> None:
    seen: list[tuple[str, str, Any, int, str]] = []
    feature = Feature("ctx")

    @feature.job("look")
    def look(payload: dict[str, Any], ctx: JobContext) -> None:
        seen.append((ctx.job_name, ctx.message_id, ctx.app, ctx.attempt, ctx.meta.trigger))

    recorder = Recorder()
    runner = make_runner(Registry([feature]), context={"db": "conn"}, **recorder.hooks())
    runner.start()
    message_id = runner.dispatch("ctx:job:look")
    recorder.wait_until(lambda r: bool(r.of("complete")))
    assert seen == [("ctx:job:look", message_id, {"db": "conn"}, 1, "manual")]
    [start] = recorder.of("start")
    assert (start.meta.tenant_id, start.meta.max_attempts) == (None, 1)


def test_a_failing_hook_does_not_stop_the_worker(make_runner: RunnerFactory) -> None:
    done = threading.Event()

    def bad_hook(*args: Any) -> None:
        raise RuntimeError("hook bug")

    runner = make_runner(
        billing_registry(), on_job_start=bad_hook, on_job_complete=lambda *a: done.set()
    )
    runner.start()
    runner.dispatch("billing:job:send")
    assert done.wait(10)


def test_a_malformed_message_is_dead_lettered_and_the_worker_goes_on(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    from dramatiq.message import Message

    runner = make_runner(billing_registry(), **recorder.hooks())
    runner.start()
    bad: Message[Any] = Message(
        queue_name=f"{prefix}-worker",
        actor_name="billing:job:send",
        args=("not", "a payload"),
        kwargs={},
        options={},
    )
    runner.broker.enqueue(bad)
    good = runner.dispatch("billing:job:send")
    recorder.wait_until(lambda r: bool(r.of("complete")))
    assert [e.message_id for e in recorder.of("complete")] == [good]
    from tests.conftest import wait_for

    wait_for(lambda: redis_client.zcard(f"dramatiq:{prefix}-worker.XQ") == 1)


def test_undecodable_bytes_on_the_queue_are_dead_lettered_and_the_worker_goes_on(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    from tests.conftest import wait_for

    runner = make_runner(billing_registry(), **recorder.hooks())
    before = runner.dispatch("billing:job:send")
    # Written the way Dramatiq's enqueue writes a message, but not a message.
    redis_client.hset(f"dramatiq:{prefix}-worker.msgs", "garbage-1", b"\x00\xffnot json")
    redis_client.rpush(f"dramatiq:{prefix}-worker", "garbage-1")
    after = runner.dispatch("billing:job:send")
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == 2)
    assert sorted(e.message_id for e in recorder.of("complete")) == sorted([before, after])
    wait_for(lambda: redis_client.zcard(f"dramatiq:{prefix}-worker.XQ") == 1, what="dead letter")
    assert redis_client.zscore(f"dramatiq:{prefix}-worker.XQ", "garbage-1") is not None


def test_an_enqueue_resent_after_a_dropped_connection_stores_the_message_once(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    from kumiko_dramatiq.messages import build_message

    runner = make_runner(billing_registry())
    job = runner.registry.jobs["billing:job:send"]
    prepared = runner.broker.prepare(
        build_message(job, {}, queue_prefix=prefix, trigger="manual"), None
    )
    rid = prepared.options["redis_message_id"]
    keys = [
        f"dramatiq:{prefix}-worker.msgs",
        f"dramatiq:{prefix}-worker",
        f"kumiko:{prefix}:sent:{rid}",
    ]
    args = [rid, prepared.encode(), 60_000, "1"]
    enqueue = runner.broker.lua.guarded_enqueue
    # The same command sent twice, as redis-py re-sends it when the reply was lost,
    assert enqueue(keys=keys, args=args) == [1]
    # even after the first copy was consumed and acked.
    redis_client.delete(f"dramatiq:{prefix}-worker", f"dramatiq:{prefix}-worker.msgs")
    assert enqueue(keys=keys, args=args) == [0]
    assert queued(redis_client, prefix) == 0


@pytest.mark.parametrize("flush", ["script_flush", "function_flush"])
def test_a_dispatch_and_a_run_after_the_server_lost_its_scripts_load_them_again(
    flush: str,
) -> None:
    # SCRIPT FLUSH empties the script cache of the whole server, FUNCTION FLUSH its functions
    # (the hot path: enqueue, lane fetch, settle), as a restart without persistence does: on
    # a private one
    with private_redis_server() as url:
        client = redis.Redis.from_url(url)
        lose = getattr(client, flush)
        runner = JobRunner(billing_registry(), redis_url=url, queue_prefix="flushed")
        try:
            first = runner.dispatch("billing:job:send", {"n": 1})
            lose()
            second = runner.dispatch("billing:job:send", {"n": 2})
            assert first != second
            assert queued(client, "flushed") == 2
            lose()
            runner.start()
            runner.drain(timeout_s=30)
            assert queued(client, "flushed") == 0
            assert {run.status for run in runner.runs()} == {"completed"}
        finally:
            runner.stop()
            client.close()


def test_each_thread_keeps_its_own_connection_until_it_ends(make_runner: RunnerFactory) -> None:
    # Given a runner's broker
    broker = make_runner(billing_registry()).broker
    # When this thread and another one (that then ends) ask for their client
    mine = broker.thread_client()
    other: list[redis.Redis] = []
    thread = threading.Thread(target=lambda: other.append(broker.thread_client()))
    thread.start()
    thread.join()
    # Then each keeps one of its own, on one connection, that works
    assert broker.thread_client() is mine
    assert other[0] is not mine
    assert mine.connection is not None
    assert mine.connection is not other[0].connection
    assert mine.ping()
    # And when they are given back (a worker's shutdown does it), the ended thread's goes back
    # to the pool, the live thread's stays with it
    broker.close_thread_clients()
    assert other[0].connection is None
    assert broker.thread_client() is mine
    assert mine.ping()
    # And closing the broker gives back every one: a thread that asks again gets a new one
    broker.close()
    assert mine.connection is None
    fresh = broker.thread_client()
    assert fresh is not mine
    assert fresh.ping()


def test_a_forked_child_never_talks_on_its_parents_connection(make_runner: RunnerFactory) -> None:
    # Given a broker whose main thread took its own connection, then a fork
    broker = make_runner(billing_registry()).broker
    parent = broker.thread_client()
    assert parent.ping()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether it got a connection of its own, and if it works
        try:
            child = broker.thread_client()
            ok = child is not parent and child.connection is not parent.connection
            os.write(write, b"1" if ok and child.ping() else b"0")
        finally:
            os._exit(0)
    os.close(write)
    # Then the child got one of its own that works, and the parent's still works
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    os.close(read)
    assert broker.thread_client() is parent
    assert parent.ping()


def test_messages_claimed_by_a_fetch_whose_reply_was_lost_go_back_and_run(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str
) -> None:
    release = threading.Event()
    feature = Feature("lost")

    @feature.job("work")
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        if payload.get("hold"):
            release.wait(20)

    # Given a live worker with one thread, busy (so its consumer fetches nothing more)
    runner = make_runner(
        Registry([feature]), worker_threads=1, heartbeat_timeout_ms=2_000, **recorder.hooks()
    )
    runner.start()
    held = runner.dispatch("lost:job:work", {"hold": True})
    recorder.wait_until(lambda r: bool(r.of("start")), what="the held run")
    # (and its next message held ahead of it: the consumer is full)
    ahead = runner.dispatch("lost:job:work", {"hold": True})
    wait_for(
        lambda: any(
            text(entry).startswith("h")
            for entry in runner.broker.client.hvals(keys.inflight(prefix))
        ),
        what="the message held ahead",
    )
    # and two messages claimed for it by a fetch whose reply it never got (a connection lost
    # mid-fetch, or a fetch sent into a cut link that Redis ran once the link was back)
    lost = [runner.dispatch("lost:job:work") for _ in range(2)]
    fetch, _, _ = runner.broker.fetch_lane(f"{prefix}-worker", Claim(2, 0, 2))
    assert sorted(Message.decode(body).message_id for _, body in fetch.fetched if body) == sorted(
        lost
    )
    # When it is free again
    release.set()
    # Then they run there, once each, as first attempts (never presumed dead: it is alive)
    recorder.wait_until(
        lambda r: {e.message_id for e in r.of("complete")} == {held, ahead, *lost},
        what="the runs of the lost claims",
    )
    runner.drain(timeout_s=10)
    done = recorder.of("complete")
    assert sorted(e.message_id for e in done) == sorted([held, ahead, *lost])
    assert {e.meta.attempt for e in done} == {1}
