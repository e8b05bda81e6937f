"""A poison job (kills its worker process on every delivery) beside a healthy job.

``KUMIKO_APP=tests.apps.poison_app:registry``. Every run pushes its message id onto
``kumiko:{prefix}:test:started:{job}`` first; ``healthy`` then pushes it onto
``kumiko:{prefix}:test:done``. ``poison`` ends the process: ``os._exit(1)``, or a segfault
when its payload says ``{"how": "segfault"}``.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import redis

from kumiko_dramatiq import Feature, JobContext, Registry

feature = Feature("poison")


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ["KUMIKO_REDIS_URL"])


def record_key(what: str) -> str:
    return f"kumiko:{os.environ['KUMIKO_QUEUE_PREFIX']}:test:{what}"


@feature.job("poison")
def poison(payload: dict[str, Any], ctx: JobContext) -> None:
    _client().rpush(record_key("started:poison"), ctx.message_id)
    if payload.get("how") == "segfault":
        ctypes.string_at(0)
    os._exit(1)


@feature.job("healthy")
def healthy(payload: dict[str, Any], ctx: JobContext) -> None:
    client = _client()
    client.rpush(record_key("started:healthy"), ctx.message_id)
    client.rpush(record_key("done"), ctx.message_id)


registry = Registry([feature])
