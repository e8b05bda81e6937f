"""A capped job for worker subprocess tests (``KUMIKO_APP=tests.apps.caps_app:registry``).

``capsapp:job:work`` runs at most :data:`MAX_RUNNING` at once; ``capsapp:job:rated`` starts at
most :data:`RATE_COUNT` runs per :data:`RATE_PER_MS`. The handler records its start
and end (``time.monotonic()``: one clock for every process of the machine), with its process
id, as JSON in the Redis list :func:`events_key` of the worker's ``KUMIKO_QUEUE_PREFIX``; it
runs ``payload["hold_s"]`` seconds, or with ``{"hold": true}`` until the key
:func:`release_key` exists (at most :data:`HOLD_LIMIT_S`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis

from kumiko_dramatiq import Feature, JobContext, RateLimit, Registry

JOB = "capsapp:job:work"
RATED = "capsapp:job:rated"
MAX_RUNNING = 2
#: ``capsapp:job:rated``: at most RATE_COUNT starts in any window of RATE_PER_MS.
RATE_COUNT = 4
RATE_PER_MS = 1_000
HOLD_LIMIT_S = 60.0

capsapp = Feature("capsapp")


def events_key(prefix: str) -> str:
    return f"kumiko:{prefix}:test:caps:events"


def release_key(prefix: str) -> str:
    return f"kumiko:{prefix}:test:caps:release"


@capsapp.job("rated", rate_limit=RateLimit(RATE_COUNT, RATE_PER_MS), retries=2)
def rated(payload: dict[str, Any], ctx: JobContext) -> None:
    work(payload, ctx)


@capsapp.job("work", max_running=MAX_RUNNING, retries=2)
def work(payload: dict[str, Any], ctx: JobContext) -> None:
    prefix = os.environ["KUMIKO_QUEUE_PREFIX"]
    client = redis.Redis.from_url(os.environ["KUMIKO_REDIS_URL"])
    try:

        def record(event: str) -> None:
            entry = {
                "event": event,
                "name": payload["name"],
                "pid": os.getpid(),
                "message_id": ctx.message_id,
                "attempt": ctx.attempt,
                "at": time.monotonic(),
            }
            client.rpush(events_key(prefix), json.dumps(entry))

        record("start")
        time.sleep(float(payload.get("hold_s", 0)))
        deadline = time.monotonic() + HOLD_LIMIT_S
        while payload.get("hold") and not client.exists(release_key(prefix)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        record("end")
    finally:
        client.close()


registry = Registry([capsapp])
