"""``Boot``: boot gates and boot-once jobs, run when a worker process boots.

Placeholder of the foundation: the boot-once marker and boot gates land in
their own change. ``JobRunner.start()`` calls :meth:`Boot.run` directly (so a
failure raises); ``dramatiq kumiko_dramatiq.app`` reaches it through
``after_process_boot`` in every worker process.
"""

from __future__ import annotations

import logging

from dramatiq.broker import Broker
from dramatiq.middleware import Middleware

from ..runtime import Runtime

logger = logging.getLogger("kumiko_dramatiq")


class Boot(Middleware):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        #: Set by ``JobRunner.start()``, which runs :meth:`run` itself.
        self.driven_by_runner = False

    def after_process_boot(self, broker: Broker) -> None:
        if not self.driven_by_runner:
            self.run(broker)

    def run(self, broker: Broker) -> None:
        """Run the lane's boot gates, then enqueue its boot-once jobs."""
