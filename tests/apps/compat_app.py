"""An existing Dramatiq app moved onto kumiko: a plain actor declared in the app module.

``KUMIKO_APP=tests.apps.compat_app:registry``: ``record`` is a plain ``@dramatiq.actor``
declared at import, before any kumiko broker exists, on the queue ``f"{prefix}_plain"`` (not a
lane); it pushes its argument onto ``kumiko:{prefix}:test:seen``.
``KUMIKO_APP=tests.apps.compat_app:with_dramatiq_retries``: a runner whose broker also
carries Dramatiq's own ``Retries``, which every start path refuses.
"""

from __future__ import annotations

import os

import dramatiq
import redis
from dramatiq.middleware import Retries

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry

URL = os.environ["KUMIKO_REDIS_URL"]
PREFIX = os.environ["KUMIKO_QUEUE_PREFIX"]
client = redis.Redis.from_url(URL)


@dramatiq.actor(queue_name=f"{PREFIX}_plain", max_retries=0)
def record(value: str) -> None:
    client.rpush(f"kumiko:{PREFIX}:test:seen", value)


compat = Feature("compat")


@compat.job("noop")
def noop(payload: dict[str, object], ctx: JobContext) -> None:
    return None


registry = Registry([compat])

with_dramatiq_retries = JobRunner(Registry([compat]), redis_url=URL, queue_prefix=PREFIX)
with_dramatiq_retries.broker.add_middleware(Retries())
