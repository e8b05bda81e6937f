"""The app's kumiko jobs."""

from __future__ import annotations

import os
from typing import Any

import redis

from kumiko_dramatiq import Feature, JobContext, Registry

shop = Feature("shop")


@shop.job("note")
def note(payload: dict[str, Any], ctx: JobContext) -> None:
    client = redis.Redis.from_url(os.environ["KUMIKO_REDIS_URL"])
    client.rpush(f"kumiko:{os.environ['KUMIKO_QUEUE_PREFIX']}:test:seen", payload["text"])
    client.close()


registry = Registry([shop])
