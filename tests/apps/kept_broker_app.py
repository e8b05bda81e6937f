"""An ``app.py`` as docs/dramatiq.md shows it, importing an unchanged Dramatiq module that kept
a reference to the global broker (:mod:`tests.apps.kept_broker_tasks`).

``KUMIKO_APP=tests.apps.kept_broker_app:runner``.
"""

from __future__ import annotations

import os

import tests.apps.kept_broker_tasks  # noqa: F401  (its actors, unchanged)
from kumiko_dramatiq import JobRunner, Registry

runner = JobRunner(
    Registry([]),
    redis_url=os.environ["KUMIKO_REDIS_URL"],
    queue_prefix=os.environ["KUMIKO_QUEUE_PREFIX"],
)
