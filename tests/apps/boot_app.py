"""Boot apps for worker and ``kumiko`` subprocess tests.

``registry``: a boot gate and a boot-once job that each push the pid of the
process that ran them onto ``kumiko:{prefix}:test:gate`` / ``...:test:boot``
(Redis and prefix from ``KUMIKO_REDIS_URL`` / ``KUMIKO_QUEUE_PREFIX``), plus
a plain job without boot options.

``failing_registry``: a boot gate that always fails, and a boot-once job
that must therefore never be enqueued.
"""

from __future__ import annotations

import os
from typing import Any

import redis

from kumiko_dramatiq import Feature, JobContext, Registry

GATE = "bootapp:job:check_schema"
BOOT = "bootapp:job:warm_cache"
PLAIN = "bootapp:job:plain"
FAILING_GATE = "failingapp:job:check_schema"
FAILING_BOOT = "failingapp:job:warm_cache"
GATE_ERROR = "schema version 3 required, found 2"


def record_key(prefix: str, what: str) -> str:
    return f"kumiko:{prefix}:test:{what}"


def _record(what: str) -> None:
    client = redis.Redis.from_url(os.environ["KUMIKO_REDIS_URL"])
    try:
        client.rpush(record_key(os.environ["KUMIKO_QUEUE_PREFIX"], what), os.getpid())
    finally:
        client.close()


bootapp = Feature("bootapp")


@bootapp.job("check_schema", boot_gate=True)
def check_schema(payload: dict[str, Any], ctx: JobContext) -> None:
    _record("gate")


@bootapp.job("warm_cache", run_on_boot=True)
def warm_cache(payload: dict[str, Any], ctx: JobContext) -> None:
    _record("boot")


@bootapp.job("plain")
def plain(payload: dict[str, Any], ctx: JobContext) -> None:
    pass


registry = Registry([bootapp])

failingapp = Feature("failingapp")


@failingapp.job("check_schema", boot_gate=True, retries=1)
def failing_gate(payload: dict[str, Any], ctx: JobContext) -> None:
    _record("gate")
    raise RuntimeError(GATE_ERROR)


@failingapp.job("warm_cache", run_on_boot=True)
def never_enqueued(payload: dict[str, Any], ctx: JobContext) -> None:
    _record("boot")


failing_registry = Registry([failingapp])
