"""Dramatiq's rate limiters on Redis: a ``ConcurrentRateLimiter`` used as a mutex, whose
``RateLimitExceeded`` is retried by Dramatiq's retry options until every message ran."""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq.rate_limits import ConcurrentRateLimiter
from dramatiq.rate_limits.backends import RedisBackend

from tests.compat.apps.common import URL, Context, client, of, record

COUNT = 12
MUTEX = ConcurrentRateLimiter(RedisBackend(url=URL), "compat-mutex", limit=1)


@dramatiq.actor(max_retries=100, min_backoff=20, max_backoff=100)
def exclusive(n: int) -> None:
    with MUTEX.acquire():
        inside = client().incr("compat-apps:inside")
        try:
            record("ran", n=n, inside=inside)
        finally:
            client().decr("compat-apps:inside")


def drive(ctx: Context) -> dict[str, Any]:
    with ctx.worker(threads=4):
        for n in range(COUNT):
            exclusive.send(n)
        seen = ctx.wait(lambda s: len(of(s, "ran")) == COUNT, f"{COUNT} exclusive runs")
    return {
        "ran": sorted(e["n"] for e in of(seen, "ran")),
        "most_inside_at_once": max(e["inside"] for e in of(seen, "ran")),
        "dead": of(seen, "dead"),
    }
