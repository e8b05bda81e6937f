"""An app to operate with the ``kumiko`` command (``KUMIKO_APP=tests.apps.ops_app:registry``).

Handlers take their cues from Redis keys of the test's prefix (``KUMIKO_REDIS_URL``,
``KUMIKO_QUEUE_PREFIX``), so they behave the same in a worker subprocess:
``flaky`` fails until ``kumiko:{prefix}:test:fixed`` exists; ``block`` and ``seq`` run until
``kumiko:{prefix}:test:release`` exists; every run pushes its message id onto
``kumiko:{prefix}:test:ran:{job}``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from kumiko_dramatiq import Cron, Feature, JobContext, Registry

ops = Feature("ops")


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ["KUMIKO_REDIS_URL"])


def test_key(what: str) -> str:
    return f"kumiko:{os.environ['KUMIKO_QUEUE_PREFIX']}:test:{what}"


def _ran(ctx: JobContext) -> redis.Redis:
    client = _client()
    client.rpush(test_key(f"ran:{ctx.job_name}"), ctx.message_id)
    return client


@ops.job("flaky", retries=1)
def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
    if not _ran(ctx).exists(test_key("fixed")):
        raise RuntimeError(f"export failed on attempt {ctx.attempt}: <disk full>")


@ops.job("block")
def block(payload: dict[str, Any], ctx: JobContext) -> None:
    client = _ran(ctx)
    while not client.exists(test_key("release")):
        time.sleep(0.02)


@ops.job("seq", concurrency="sequential")
def seq(payload: dict[str, Any], ctx: JobContext) -> None:
    block(payload, ctx)


@ops.job("note")
def note(payload: dict[str, Any], ctx: JobContext) -> None:
    _ran(ctx)


@ops.job("tick", trigger=Cron("* * * * * *"))
def tick(payload: dict[str, Any], ctx: JobContext) -> None:
    _ran(ctx)


@ops.job(
    "reconcile_every_customer_invoice_against_the_general_ledger",
    trigger=Cron("0 3 * * *", timezone="America/Argentina/Buenos_Aires"),
)
def reconcile(payload: dict[str, Any], ctx: JobContext) -> None:
    _ran(ctx)


registry = Registry([ops])
