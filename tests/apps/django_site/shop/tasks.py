"""The app's Dramatiq actors, found by ``rundramatiq`` (unchanged by the move to kumiko)."""

from __future__ import annotations

import dramatiq
import redis
from django.conf import settings

PREFIX = settings.KUMIKO_QUEUE_PREFIX
client = redis.Redis.from_url(settings.KUMIKO_REDIS_URL)


@dramatiq.actor(queue_name=f"{PREFIX}_plain", max_retries=0)
def record(value: str) -> None:
    client.rpush(f"kumiko:{PREFIX}:test:seen", value)
