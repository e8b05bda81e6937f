"""An existing Dramatiq module, unchanged: it keeps a reference to the global broker.

As Dramatiq's own ``max_tasks_per_child`` example does, it takes ``dramatiq.get_broker()`` at
import, adds a middleware through that reference, and uses it again at run time: ``relay``
enqueues through it and looks an actor up on it. ``record`` pushes its argument onto
``kumiko:{prefix}:test:seen``; the middleware pushes each processed actor's name onto
``kumiko:{prefix}:test:processed``. The app module is :mod:`tests.apps.kept_broker_app`.
"""

from __future__ import annotations

import os
from typing import Any

import dramatiq
import redis
from dramatiq.broker import Broker
from dramatiq.middleware import Middleware

PREFIX = os.environ["KUMIKO_QUEUE_PREFIX"]
QUEUE = f"{PREFIX}_plain"
client = redis.Redis.from_url(os.environ["KUMIKO_REDIS_URL"])


class Processed(Middleware):
    """Notes the name of every actor whose message was processed."""

    def after_process_message(
        self, broker: Broker, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        client.rpush(f"kumiko:{PREFIX}:test:processed", message.actor_name)


broker = dramatiq.get_broker()
broker.add_middleware(Processed())


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def record(value: str) -> None:
    client.rpush(f"kumiko:{PREFIX}:test:seen", value)


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def relay(value: str) -> None:
    broker.enqueue(record.message(f"{value} via enqueue"))
    broker.get_actor("record").send(f"{value} via get_actor")
