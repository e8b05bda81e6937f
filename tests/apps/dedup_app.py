"""The app of the dedup subprocess tests (``KUMIKO_APP=tests.apps.dedup_app:registry``).

``dedup:job:block_once`` records every run into Redis lists under the test's
prefix (so the prefix cleanup removes them): ``started`` gets the message id
when a run begins, ``done`` a JSON ``{"id", "payload"}`` when it ends. The
very first run of a dataset blocks (up to 60 s) so a test can kill its worker
mid-run; every later run returns at once.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis

from kumiko_dramatiq import Feature, JobContext, Registry

BLOCK_ONCE = "dedup:job:block_once"

dedup = Feature("dedup")


def record_key(prefix: str, what: str) -> str:
    """The list ``what`` ("started" | "done" | "never") of the test with queue prefix ``prefix``."""
    return f"kumiko:{prefix}:test:{what}"


@dedup.job("block_once")
def block_once(payload: dict[str, Any], ctx: JobContext) -> None:
    prefix = os.environ["KUMIKO_QUEUE_PREFIX"]
    client = redis.Redis.from_url(os.environ["KUMIKO_REDIS_URL"])
    try:
        runs = client.rpush(record_key(prefix, "started"), ctx.message_id)
        if runs == 1:
            client.blpop([record_key(prefix, "never")], timeout=60)
        client.rpush(
            record_key(prefix, "done"), json.dumps({"id": ctx.message_id, "payload": payload})
        )
    finally:
        client.close()


registry = Registry([dedup])
