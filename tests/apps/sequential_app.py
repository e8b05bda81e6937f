"""A sequential job for worker subprocess tests.

``KUMIKO_APP=tests.apps.sequential_app:registry``. The handler records its
start and end, with its process id, as JSON in the Redis list
:func:`events_key` of the worker's ``KUMIKO_QUEUE_PREFIX``; with
``{"hold": true}`` it keeps running (and holding the lock) until the key
:func:`release_key` exists, at most :data:`HOLD_LIMIT_S`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis

from kumiko_dramatiq import Feature, JobContext, Registry

JOB = "seqapp:job:hold"
HOLD_LIMIT_S = 60.0

seqapp = Feature("seqapp")


def events_key(prefix: str) -> str:
    return f"kumiko:{prefix}:test:sequential:events"


def release_key(prefix: str) -> str:
    return f"kumiko:{prefix}:test:sequential:release"


@seqapp.job("hold", concurrency="sequential")
def hold(payload: dict[str, Any], ctx: JobContext) -> None:
    prefix = os.environ["KUMIKO_QUEUE_PREFIX"]
    client = redis.Redis.from_url(os.environ["KUMIKO_REDIS_URL"])
    try:

        def record(event: str) -> None:
            entry = {
                "event": event,
                "name": payload["name"],
                "pid": os.getpid(),
                "message_id": ctx.message_id,
            }
            client.rpush(events_key(prefix), json.dumps(entry))

        record("start")
        deadline = time.monotonic() + HOLD_LIMIT_S
        while payload.get("hold") and not client.exists(release_key(prefix)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        record("end")
    finally:
        client.close()


registry = Registry([seqapp])
