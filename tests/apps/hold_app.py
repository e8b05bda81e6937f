"""A job for held messages (tests/integration/test_holds.py, benchmarks/cancel_held.py), run
by a CLI worker.

``KUMIKO_APP=tests.apps.hold_app:registry``. Every run pushes its message id onto
``kumiko:{prefix}:test:started``; a run whose payload says ``"block": true`` then waits until
``kumiko:{prefix}:test:release`` exists (the test sets it).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from kumiko_dramatiq import Feature, JobContext, Registry

feature = Feature("hold")


def _key(name: str) -> str:
    return f"kumiko:{os.environ['KUMIKO_QUEUE_PREFIX']}:test:{name}"


@feature.job("work")
def work(payload: dict[str, Any], ctx: JobContext) -> None:
    client = redis.Redis.from_url(os.environ["KUMIKO_REDIS_URL"])
    client.rpush(_key("started"), ctx.message_id)
    while payload.get("block") and not client.exists(_key("release")):
        time.sleep(0.01)


registry = Registry([feature])
