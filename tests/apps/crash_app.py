"""A job whose first delivery hangs until its worker is killed; later ones complete.

``KUMIKO_APP=tests.apps.crash_app:registry``. The first run pushes its message id onto
``kumiko:{prefix}:test:hanging`` and sleeps; the test SIGKILLs that worker.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from kumiko_dramatiq import Feature, JobContext, Registry

feature = Feature("crash")


@feature.job("once")
def once(payload: dict[str, Any], ctx: JobContext) -> None:
    client = redis.Redis.from_url(os.environ["KUMIKO_REDIS_URL"])
    key = f"kumiko:{os.environ['KUMIKO_QUEUE_PREFIX']}:test:hanging"
    if client.rpush(key, ctx.message_id) == 1:
        time.sleep(600)


registry = Registry([feature])
