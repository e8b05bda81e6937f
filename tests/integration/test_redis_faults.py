"""Faults of Redis itself, seen from kumiko's API: each failure is one of kumiko's errors with
one line saying what to do (never a raw redis-py exception), and nothing is half-written."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from examples.redis_server import private_redis
from kumiko_dramatiq import (
    Feature,
    JobContext,
    JobRunner,
    RedisAccessError,
    RedisUnavailableError,
    Registry,
)
from kumiko_dramatiq.testing import private_redis_server
from tests.conftest import wait_for


def registry() -> Registry:
    feature = Feature("faults")

    @feature.job("work")
    def work(payload: dict[str, Any], ctx: JobContext) -> None: ...

    return Registry([feature])


@pytest.fixture
def private_url() -> Iterator[str]:
    with private_redis_server() as url:
        yield url


def test_a_database_the_server_does_not_have_is_a_kumiko_error_naming_it(
    private_url: str,
) -> None:
    # Given a server with the default 16 databases and a URL naming database 16
    url = private_url.replace("db=0", "db=16")
    runner = JobRunner(registry(), redis_url=url, queue_prefix="faults")
    # When a producer dispatches, Then it is refused in one line naming the database
    with runner, pytest.raises(RedisAccessError, match="has no such database"):
        runner.dispatch("faults:job:work", {})


def fill(client: redis.Redis) -> int:
    """Write another app's keys until Redis refuses one (OOM); how many it took."""
    for i in range(10_000):
        try:
            client.set(f"other-app:{i}", "x" * 1024)
        except redis.exceptions.OutOfMemoryError:
            return i
    return 10_000


def test_a_redis_out_of_memory_refuses_dispatch_with_a_kumiko_error(private_url: str) -> None:
    # Given a server at its maxmemory with the noeviction policy
    client = redis.Redis.from_url(private_url)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 64 * 1024)
    filled = fill(client)
    assert filled < 10_000
    with JobRunner(registry(), redis_url=private_url, queue_prefix="faults") as runner:
        # When a producer dispatches, Then it gets kumiko's error naming maxmemory
        with pytest.raises(RedisUnavailableError, match="maxmemory") as raised:
            runner.dispatch("faults:job:work", {})
        assert "\n" not in str(raised.value)
        # and once memory is freed, the same runner dispatches again
        client.config_set("maxmemory", 0)
        assert runner.dispatch("faults:job:work", {})
    client.close()


def test_a_dispatch_that_never_reached_redis_says_it_was_not_enqueued() -> None:
    # Given a URL where nothing listens
    runner = JobRunner(
        registry(),
        redis_url="redis://127.0.0.1:1/0",
        queue_prefix="faults",
        boot_redis_timeout_ms=500,
    )
    # When a producer dispatches, Then the error says the request never reached Redis
    with runner, pytest.raises(RedisUnavailableError) as raised:
        runner.dispatch("faults:job:work", {})
    assert raised.value.maybe_enqueued is False
    assert "may have been enqueued" not in str(raised.value)


def test_a_dispatch_that_timed_out_after_sending_may_have_been_enqueued() -> None:
    with private_redis("--enable-debug-command", "yes") as private_url:
        stalled_dispatch(private_url)


def stalled_dispatch(private_url: str) -> None:
    # Given a producer whose Redis answers, then stalls longer than its socket timeout
    runner = JobRunner(
        registry(), redis_url=private_url, queue_prefix="faults", boot_redis_timeout_ms=300
    )
    with runner:
        runner.dispatch("faults:job:work", {})  # connected
        stall = redis.Redis.from_url(private_url)
        sleeper = threading.Thread(
            target=lambda: stall.execute_command("DEBUG", "SLEEP", "1.5")  # type: ignore[no-untyped-call]
        )
        sleeper.start()
        # wait until the server is inside the sleep: a command from another client blocks
        blocked = redis.Redis.from_url(private_url, socket_timeout=0.1)
        wait_for(lambda: _times_out(blocked), what="the server to stall")

        # When a dispatch is sent meanwhile, Then its error says it may have been enqueued
        with pytest.raises(RedisUnavailableError) as raised:
            runner.dispatch("faults:job:work", {"n": 2})
        sleeper.join(10)
        assert raised.value.maybe_enqueued is True
        assert "may have been enqueued" in str(raised.value)
        # and so it was: the command ran once Redis woke
        assert runner.job_counts()["faults:job:work"]["queued"] == 2


def _times_out(client: redis.Redis) -> bool:
    try:
        client.ping()
    except redis.TimeoutError:
        return True
    return False


def test_a_refused_boot_once_enqueue_is_a_kumiko_error(private_url: str) -> None:
    # Given a server at its maxmemory (noeviction) and a lane with a boot-once job
    feature = Feature("faults")

    @feature.job("warm", run_on_boot=True)
    def warm(payload: dict[str, Any], ctx: JobContext) -> None: ...

    client = redis.Redis.from_url(private_url)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 64 * 1024)
    fill(client)
    runner = JobRunner(Registry([feature]), redis_url=private_url, queue_prefix="faults")
    # When the worker starts, Then the refused write is kumiko's error, not redis-py's
    with runner, pytest.raises(RedisUnavailableError, match="maxmemory"):
        runner.start()
    client.config_set("maxmemory", 0)
    client.close()
