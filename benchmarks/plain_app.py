"""The app of :mod:`benchmarks.plain_actors`: plain Dramatiq actors, unchanged between the two
brokers. ``BENCH_BROKER=plain``: ``dramatiq benchmarks.plain_app`` on Dramatiq's
``RedisBroker``; ``BENCH_BROKER=kumiko``: ``KUMIKO_APP=benchmarks.plain_app:runner dramatiq
kumiko_dramatiq.app``. Every actor pushes its argument onto :data:`DONE` when it ends well.
"""

from __future__ import annotations

import asyncio
import os
import time

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware.asyncio import AsyncIO

from kumiko_dramatiq import JobRunner, Registry

URL = os.environ["BENCH_REDIS_URL"]
DONE = "bench:done"
client = redis.Redis.from_url(URL)

if os.environ["BENCH_BROKER"] == "plain":
    dramatiq.set_broker(RedisBroker(url=URL))  # type: ignore[no-untyped-call]

dramatiq.get_broker().add_middleware(AsyncIO())  # as Dramatiq's asyncio example does


@dramatiq.actor(max_retries=0)
def sleeper(n: int) -> None:
    time.sleep(0.1)
    client.rpush(DONE, n)


@dramatiq.actor(max_retries=0)
async def async_sleeper(n: int) -> None:
    await asyncio.sleep(0.1)
    client.rpush(DONE, n)


@dramatiq.actor(max_retries=1, min_backoff=100, max_backoff=100)
def fails_once(n: int) -> None:
    time.sleep(0.1)
    if client.incr(f"bench:attempts:{n}") == 1:
        raise RuntimeError("first attempt fails")
    client.rpush(DONE, n)


runner = JobRunner(Registry([]), redis_url=URL) if os.environ["BENCH_BROKER"] == "kumiko" else None
