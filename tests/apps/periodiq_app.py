"""Periodic actors scheduled by periodiq on kumiko's broker, as docs/dramatiq.md shows it.

``KUMIKO_APP=tests.apps.periodiq_app:runner``: workers ``dramatiq kumiko_dramatiq.app``, the
scheduler ``periodiq kumiko_dramatiq.app``. ``every_minute`` pushes ``"tick"`` onto
``kumiko:{prefix}:test:seen``; periodiq sends it when it starts and then every minute.
"""

from __future__ import annotations

import os

import dramatiq
import redis
from periodiq import PeriodiqMiddleware, cron

from kumiko_dramatiq import JobRunner, Registry

URL = os.environ["KUMIKO_REDIS_URL"]
PREFIX = os.environ["KUMIKO_QUEUE_PREFIX"]
client = redis.Redis.from_url(URL)


@dramatiq.actor(queue_name=f"{PREFIX}_plain", periodic=cron("* * * * *"), max_retries=0)
def every_minute() -> None:
    client.rpush(f"kumiko:{PREFIX}:test:seen", "tick")


runner = JobRunner(Registry([]), redis_url=URL, queue_prefix=PREFIX)
runner.broker.add_middleware(PeriodiqMiddleware(skip_delay=30))
