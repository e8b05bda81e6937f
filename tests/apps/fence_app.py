"""A sequential job whose run sits in a blocking C call, for the fencing test of a CLI worker.

``KUMIKO_APP=tests.apps.fence_app:runner`` with ``KUMIKO_REDIS_URL`` pointing at a proxy the
test can cut, and ``FENCE_EVENTS_URL`` at the real Redis: the handler pushes its message id and
process id there (JSON, on :func:`events_key`), then sleeps in ``time.sleep`` (a C call an
asynchronous exception cannot interrupt) far longer than its lease.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry

JOB = "fenceapp:job:stuck"
#: The lease: renewed every 2.7 s, fenced 6 s after the last renewal went out, the
#: process ended at 7.2 s, the lock expires 8 s after Redis took the last renewal.
LOCK_TTL_MS = 8_000

fenceapp = Feature("fenceapp")


def events_key(prefix: str) -> str:
    return f"kumiko:{prefix}:test:fence:events"


@fenceapp.job("stuck", concurrency="sequential")
def stuck(payload: dict[str, Any], ctx: JobContext) -> None:
    client = redis.Redis.from_url(os.environ["FENCE_EVENTS_URL"])
    try:
        entry = {"message_id": ctx.message_id, "pid": os.getpid()}
        client.rpush(events_key(os.environ["KUMIKO_QUEUE_PREFIX"]), json.dumps(entry))
    finally:
        client.close()
    time.sleep(3_600)


runner = JobRunner(Registry([fenceapp]), lock_ttl_ms=LOCK_TTL_MS, boot_redis_timeout_ms=1_000)
