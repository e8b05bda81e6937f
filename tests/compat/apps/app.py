"""The same app moved onto kumiko as docs/dramatiq.md shows it ("Replacing the broker").

``KUMIKO_APP=tests.compat.apps.app:runner dramatiq kumiko_dramatiq.app``: the app's module,
unchanged (its ``@dramatiq.actor`` functions bind to this runner's broker through the
loader), a runner, and the middleware the app had added to its broker, added to
``runner.broker``.
"""

from __future__ import annotations

import importlib

from kumiko_dramatiq import JobRunner, Registry
from tests.compat.apps.brokers import user_middleware
from tests.compat.apps.common import APP, URL, Observed

tasks = importlib.import_module(f"tests.compat.apps.{APP}")  # your existing actors, unchanged

runner = JobRunner(Registry([]), redis_url=URL)
for middleware in user_middleware(APP):
    runner.broker.add_middleware(middleware)
runner.broker.add_middleware(Observed())
