"""Faults of Redis itself, seen from kumiko's API: each failure is one of kumiko's errors with
one line saying what to do (never a raw redis-py exception), and nothing is half-written."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kumiko_dramatiq import (
    Feature,
    JobContext,
    JobRunner,
    RedisAccessError,
    RedisUnavailableError,
    Registry,
)
from kumiko_dramatiq.testing import private_redis_server


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
