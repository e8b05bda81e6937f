"""The app of :mod:`benchmarks.delayed`: plain Dramatiq actors, unchanged between the two
brokers (``BENCH_BROKER=plain``: ``dramatiq benchmarks.delayed_app`` on Dramatiq's
``RedisBroker``; ``BENCH_BROKER=kumiko``: ``KUMIKO_APP=benchmarks.delayed_app:runner dramatiq
kumiko_dramatiq.app``). ``short`` and ``retry_once`` push their lateness (ms after their due
time) onto :data:`LATE`; ``far`` is the backlog (due in an hour, never runs here); ``noop``
counts on :data:`DONE`.
"""

from __future__ import annotations

import os
import time

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker

from kumiko_dramatiq import JobRunner, Registry

URL = os.environ["BENCH_REDIS_URL"]
LATE = "bench:late"
DONE = "bench:done"
RETRY_DELAY_MS = 1_000
client = redis.Redis.from_url(URL)

if os.environ["BENCH_BROKER"] == "plain":
    dramatiq.set_broker(RedisBroker(url=URL))  # type: ignore[no-untyped-call]


def now_ms() -> int:
    return int(time.time() * 1000)


@dramatiq.actor(max_retries=0)
def far(n: int) -> None:
    client.rpush(DONE, n)


@dramatiq.actor(max_retries=0)
def noop(n: int) -> None:
    return None


@dramatiq.actor(max_retries=0)
def short(due_ms: int) -> None:
    client.rpush(LATE, now_ms() - due_ms)


@dramatiq.actor(max_retries=3)
def retry_once(n: int) -> None:
    if client.incr(f"bench:attempts:{n}") == 1:
        client.set(f"bench:due:{n}", now_ms() + RETRY_DELAY_MS)
        raise dramatiq.Retry(delay=RETRY_DELAY_MS)
    client.rpush(LATE, now_ms() - int(client.get(f"bench:due:{n}") or 0))


runner = JobRunner(Registry([]), redis_url=URL) if os.environ["BENCH_BROKER"] == "kumiko" else None
