"""The app as it ran before kumiko: Dramatiq's ``RedisBroker`` as the global broker.

``dramatiq tests.compat.apps.plain`` (with ``COMPAT_APP`` naming the app): the broker, the
app's own middleware, then the app's module, whose actors bind to the global broker.
"""

from __future__ import annotations

import importlib

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from tests.compat.apps.brokers import user_middleware
from tests.compat.apps.common import APP, URL, Observed

broker = RedisBroker(url=URL)
for middleware in user_middleware(APP):
    broker.add_middleware(middleware)
broker.add_middleware(Observed())
dramatiq.set_broker(broker)

tasks = importlib.import_module(f"tests.compat.apps.{APP}")
