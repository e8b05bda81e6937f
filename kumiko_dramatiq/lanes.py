"""``Lane``: a worker consumes only its runner's lane.

Sets ``worker.consumer_whitelist`` to ``{f"{queue_prefix}-{lane}"}`` in
``before_worker_boot`` unless the worker already has one (``dramatiq --queues``). Used by
``JobRunner.start()`` and ``dramatiq kumiko_dramatiq.app`` alike. Touches no Redis key.
"""

from __future__ import annotations

from dramatiq.broker import Broker
from dramatiq.middleware import Middleware
from dramatiq.worker import Worker


class Lane(Middleware):
    def __init__(self, queue_name: str) -> None:
        self.queue_name = queue_name

    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        if not worker.consumer_whitelist:
            worker.consumer_whitelist = {self.queue_name}
