"""The asyncio producer (``adispatch`` and its siblings) on a real Redis: each call does what
its sync twin does, its commands travel on the loop's own connection, and the loop keeps
running while Redis is slow. Loops run with ``asyncio.run``; synchronisation is on drained
queues, results and events, never on sleeps."""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.message import Message

from examples.redis_server import private_redis
from kumiko_dramatiq import (
    Event,
    Feature,
    JobContext,
    JobRunner,
    PayloadError,
    RedisUnavailableError,
    Registry,
    ResultPending,
    UnknownJobError,
)
from kumiko_dramatiq.testing import private_redis_server
from tests.conftest import RunnerFactory, wait_for

WELCOME = "app:job:welcome"
DOUBLE = "app:job:double"


def registry() -> Registry:
    app = Feature("app")

    @app.job("welcome", retries=3)
    def welcome(payload: dict[str, Any], ctx: JobContext) -> None: ...

    @app.job("double", keep_result_s=600, trigger=Event("user.signed_up"))
    def double(payload: dict[str, Any], ctx: JobContext) -> int:
        previous = ctx.previous_result
        return 2 * int(payload.get("n", previous if previous is not None else 0))

    return Registry([app])


def bodies(client: redis.Redis, runner: JobRunner, job: str) -> list[dict[str, Any]]:
    """The messages waiting on ``job``'s queue, decoded."""
    queue = runner.job(job).queue_name(runner.queue_prefix)
    return [json.loads(raw) for raw in client.hvals(f"dramatiq:{queue}.msgs")]


def test_adispatch_writes_the_message_dispatch_writes(
    make_runner: RunnerFactory, redis_client: redis.Redis
) -> None:
    # Given one runner
    runner = make_runner(registry())

    # When the same payload is dispatched once sync and once awaited
    sync_id = runner.dispatch(WELCOME, {"user": 7})
    async_id = asyncio.run(runner.adispatch(WELCOME, {"user": 7}))

    # Then both messages carry the same options (the retry policy included), bar their ids
    by_id = {body["message_id"]: body for body in bodies(redis_client, runner, WELCOME)}
    sync_body, async_body = by_id[sync_id], by_id[async_id]
    for body in (sync_body, async_body):
        for volatile in ("message_id", "message_timestamp"):
            body.pop(volatile)
        body["options"].pop("redis_message_id")
    assert async_body == sync_body
    assert runner.job_state(async_id) == "queued"


def test_the_async_calls_open_no_sync_connection(make_runner: RunnerFactory) -> None:
    # Given a runner used only from a loop, every async call once (a worker runs the jobs)
    worker = make_runner(registry())
    worker.start()
    runner = make_runner(registry())
    pool = runner.broker.client.connection_pool
    opened_on: list[str] = []
    make_connection = pool.make_connection

    def recorded() -> Any:  # the real connection, and the thread that opened it
        opened_on.append(threading.current_thread().name)
        return make_connection()

    pool.make_connection = recorded  # type: ignore[method-assign]

    async def calls() -> tuple[Any, ...]:
        one = await runner.adispatch(DOUBLE, {"n": 1})
        many = await runner.adispatch_many(DOUBLE, [{"n": 2}, {"n": 3}])
        keyed = await runner.adispatch(DOUBLE, {"n": 4}, dedup_key="k4")
        again = await runner.adispatch(DOUBLE, {"n": 4}, idempotency_key="i4")
        same = await runner.adispatch(DOUBLE, {"n": 4}, idempotency_key="i4")
        events = await runner.ahandle_event("user.signed_up", {"n": 5})
        batch = await runner.adispatch_batch([(DOUBLE, {"n": 6}), (DOUBLE, {"n": 7})])
        chain = await runner.adispatch_chain([(DOUBLE, {"n": 8}), (DOUBLE, {})])
        value = await runner.aresult(one, timeout_s=30)
        chained = await runner.aresult(chain, timeout_s=30)
        state = await runner.ajob_state(many[1])
        status = await runner.abatch(batch)
        await runner.aclose()
        return one, many, keyed, again, same, events, value, chained, state, status

    _one, many, _keyed, again, same, events, value, chained, state, status = asyncio.run(calls())

    # Then each returned what its sync twin returns
    assert len(many) == 2
    assert len(events) == 1
    assert same == again
    assert value == 2
    assert chained == 32  # 8 * 2, then doubled again
    assert state in ("queued", "running", "completed")
    assert status.total == 2
    # and no sync connection was opened on the loop's thread (the results subscription has
    # a thread of its own) nor a thread's own connection taken
    assert set(opened_on) <= {"kumiko-results"}
    assert runner.broker._thread_clients == []
    worker.drain(timeout_s=30)
    assert runner.batch(status.id).state == "succeeded"


def test_bad_input_raises_what_dispatch_raises_and_writes_nothing(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(registry())

    async def calls() -> None:
        with pytest.raises(UnknownJobError):
            await runner.adispatch("app:job:nope", {})
        with pytest.raises(PayloadError, match="delay_ms"):
            await runner.adispatch(WELCOME, {}, delay_ms=-1)
        with pytest.raises(PayloadError, match=r"payloads\[1\]"):
            await runner.adispatch_many(WELCOME, [{}, {"x": object()}])
        with pytest.raises(PayloadError, match="idempotency_key"):
            await runner.adispatch(WELCOME, {}, dedup_key="a", idempotency_key="b")

    asyncio.run(calls())
    assert runner.job_counts()[WELCOME]["queued"] == 0


def test_the_broker_hooks_run_for_each_message_in_the_callers_context(
    make_runner: RunnerFactory,
) -> None:
    # Given a middleware that records what it sees, and a context variable the request set
    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
    seen: list[tuple[str, str, str]] = []

    class Watch(dramatiq.Middleware):
        def before_enqueue(self, broker: Any, message: Message[Any], delay: Any) -> None:
            seen.append(("before", str(message.message_id), request_id.get()))

        def after_enqueue(self, broker: Any, message: Message[Any], delay: Any) -> None:
            seen.append(("after", str(message.message_id), request_id.get()))

    runner = make_runner(registry())
    runner.broker.add_middleware(Watch())

    async def request() -> list[str]:
        request_id.set("req-1")
        return await runner.adispatch_many(WELCOME, [{}, {}])

    ids = asyncio.run(request())
    # Then each message passed both hooks, which saw the caller's context
    assert seen == [
        ("before", ids[0], "req-1"),
        ("before", ids[1], "req-1"),
        ("after", ids[0], "req-1"),
        ("after", ids[1], "req-1"),
    ]


def test_several_loops_and_a_sync_caller_share_one_runner(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry())
    found: list[str] = []
    lock = threading.Lock()

    async def produce() -> None:
        ids = await asyncio.gather(*(runner.adispatch(WELCOME, {"n": n}) for n in range(50)))
        with lock:
            found.extend(ids)

    threads = [threading.Thread(target=asyncio.run, args=(produce(),)) for _ in range(3)]
    for thread in threads:
        thread.start()
    sync_ids = [runner.dispatch(WELCOME, {"n": n}) for n in range(50)]
    for thread in threads:
        thread.join(30)
    assert len(set(found)) == 150
    assert not set(found) & set(sync_ids)
    assert runner.job_counts()[WELCOME]["queued"] == 200


def test_aresult_waits_on_the_loop_for_the_value(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry())

    async def before_and_after() -> tuple[str | None, Any]:
        mid = await runner.adispatch(DOUBLE, {"n": 21})
        with pytest.raises(ResultPending) as pending:
            await runner.aresult(mid, timeout_s=0)
        # the loop is free while it waits: the worker starts from it
        waiting = asyncio.ensure_future(runner.aresult(mid, timeout_s=30))
        await asyncio.sleep(0)
        runner.start()
        return pending.value.state, await waiting

    state, value = asyncio.run(before_and_after())
    assert state == "queued"
    assert value == 42


@pytest.fixture
def debug_url() -> Iterator[str]:
    with private_redis("--enable-debug-command", "yes") as url:
        yield url


def freeze(url: str, seconds: float) -> threading.Thread:
    """Freeze the server at ``url`` for ``seconds`` (``DEBUG SLEEP``); returns once it is."""
    stall = redis.Redis.from_url(url)
    sleeper = threading.Thread(
        target=lambda: stall.execute_command("DEBUG", "SLEEP", str(seconds))  # type: ignore[no-untyped-call]
    )
    sleeper.start()
    probe = redis.Redis.from_url(url, socket_timeout=0.1)

    def frozen() -> bool:
        try:
            probe.ping()
        except redis.TimeoutError:
            return True
        return False

    wait_for(frozen, what="the server to freeze")
    return sleeper


def test_the_loop_keeps_running_while_redis_is_frozen(debug_url: str) -> None:
    # Given a producer whose read timeout outlasts a freeze of Redis
    runner = JobRunner(
        registry(), redis_url=debug_url, queue_prefix="aio", boot_redis_timeout_ms=5_000
    )

    async def scenario() -> tuple[str, int]:
        await runner.adispatch(WELCOME, {})  # connected
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        sleeper = await asyncio.to_thread(freeze, debug_url, 1.0)
        ticking = asyncio.ensure_future(ticker())
        # When a dispatch waits on the frozen Redis
        mid = await runner.adispatch(WELCOME, {})
        stop.set()
        await ticking
        await asyncio.to_thread(sleeper.join, 10)
        return mid, ticks

    with runner:
        mid, ticks = asyncio.run(scenario())
        # Then other coroutines ran meanwhile, and the dispatch landed once Redis woke
        assert ticks >= 10
        assert runner.job_state(mid) == "queued"


def test_a_call_given_up_leaves_the_loops_connection_working(debug_url: str) -> None:
    runner = JobRunner(
        registry(), redis_url=debug_url, queue_prefix="aio", boot_redis_timeout_ms=5_000
    )

    async def scenario() -> str:
        await runner.adispatch(WELCOME, {})
        sleeper = await asyncio.to_thread(freeze, debug_url, 0.5)
        # When the caller gives up on a dispatch while Redis is frozen
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(runner.adispatch(WELCOME, {}), 0.05)
        await asyncio.to_thread(sleeper.join, 10)
        # Then the next call works on the same connection
        return await runner.adispatch(WELCOME, {})

    with runner:
        mid = asyncio.run(scenario())
        assert runner.job_state(mid) == "queued"


def test_a_timeout_after_sending_says_it_may_have_been_enqueued(debug_url: str) -> None:
    runner = JobRunner(
        registry(), redis_url=debug_url, queue_prefix="aio", boot_redis_timeout_ms=300
    )

    async def scenario() -> RedisUnavailableError:
        await runner.adispatch(WELCOME, {})
        sleeper = await asyncio.to_thread(freeze, debug_url, 1.5)
        with pytest.raises(RedisUnavailableError) as raised:
            await runner.adispatch(WELCOME, {"n": 2})
        await asyncio.to_thread(sleeper.join, 10)
        # and the next call reconnects
        await runner.adispatch(WELCOME, {"n": 3})
        return raised.value

    with runner:
        error = asyncio.run(scenario())
        assert error.maybe_enqueued is True
        assert "may have been enqueued" in str(error)
        assert runner.job_counts()[WELCOME]["queued"] == 3


def test_a_dispatch_that_never_reached_redis_says_it_was_not_enqueued() -> None:
    runner = JobRunner(
        registry(), redis_url="redis://127.0.0.1:1/0", queue_prefix="aio", boot_redis_timeout_ms=500
    )

    async def scenario() -> RedisUnavailableError:
        with pytest.raises(RedisUnavailableError) as raised:
            await runner.adispatch(WELCOME, {})
        return raised.value

    with runner:
        error = asyncio.run(scenario())
    assert error.maybe_enqueued is False
    assert "127.0.0.1:1" in str(error)


def test_a_loops_connection_closes_when_the_loop_ends() -> None:
    # Given a producer called from many short-lived loops (an asyncio.run per call)
    with private_redis_server() as url:
        watcher = redis.Redis.from_url(url)
        before = int(watcher.info("clients")["connected_clients"])
        runner = JobRunner(registry(), redis_url=url, queue_prefix="aio")
        with runner:
            for _ in range(5):
                asyncio.run(runner.adispatch(WELCOME, {}))
            # Then each loop's connection closed as its loop shut down: none is left open
            wait_for(
                lambda: int(watcher.info("clients")["connected_clients"]) == before,
                what="the loops' connections to close",
            )
            assert runner.job_counts()[WELCOME]["queued"] == 5
        watcher.close()


def test_a_connection_redis_dropped_is_made_again_by_the_next_call() -> None:
    with private_redis_server() as url:
        killer = redis.Redis.from_url(url)
        runner = JobRunner(registry(), redis_url=url, queue_prefix="aio")

        async def scenario() -> None:
            await runner.adispatch(WELCOME, {})
            # When Redis drops the loop's connection between two calls (a restart, a proxy)
            killer.execute_command("CLIENT", "KILL", "SKIPME", "yes")  # type: ignore[no-untyped-call]
            await asyncio.sleep(0)  # the loop may or may not see the drop before the call
            # Then the next call connects again and lands
            await runner.adispatch(WELCOME, {})
            killer.execute_command("CLIENT", "KILL", "SKIPME", "yes")  # type: ignore[no-untyped-call]
            await runner.adispatch_many(WELCOME, [{}, {}])

        with runner:
            asyncio.run(scenario())
            assert runner.job_counts()[WELCOME]["queued"] == 4
        killer.close()
