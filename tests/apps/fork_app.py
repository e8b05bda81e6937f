"""A worker that SIGKILLs itself after a failed attempt 2 prepared its retry, before the ack.

``KUMIKO_APP=tests.apps.fork_app:runner``; records every run in
``kumiko:{prefix}:test:runs``.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import redis
from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware

from kumiko_dramatiq import Backoff, Feature, JobContext, JobRunner, Registry

URL = os.environ["KUMIKO_REDIS_URL"]
PREFIX = os.environ["KUMIKO_QUEUE_PREFIX"]
client = redis.Redis.from_url(URL)
fork = Feature("fork")


@fork.job("always_fails", retries=2, backoff=Backoff("fixed", delay_ms=50))
def always_fails(payload: dict[str, Any], ctx: JobContext) -> None:
    client.rpush(f"kumiko:{PREFIX}:test:runs", ctx.attempt)
    raise RuntimeError(f"attempt {ctx.attempt} fails")


class KillBeforeTheAck(Middleware):
    """First in the chain, so its after-hook runs last: after Retries, before the ack."""

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        if message.options.get("kumiko_failures") != 1:
            return
        if client.set(f"kumiko:{PREFIX}:test:killed", 1, nx=True):
            os.kill(os.getpid(), signal.SIGKILL)


runner = JobRunner(Registry([fork]), redis_url=URL, queue_prefix=PREFIX)
runner.broker.middleware.insert(0, KillBeforeTheAck())
