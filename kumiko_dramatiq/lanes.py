"""``Lane``: a worker consumes its runner's lane, and no other lane of its dataset.

A worker that was given no queues (``dramatiq kumiko_dramatiq.app`` without ``--queues``, or a
``dramatiq.Worker`` built on ``runner.broker``) consumes, like any Dramatiq worker, the queue
of every actor declared on the broker, and delay queues with them, except the other lanes of
its dataset (``f"{queue_prefix}-{lane}"`` for every lane but its own): kumiko's jobs of the
other lane wait for that lane's workers, while a plain ``@dramatiq.actor``'s queue
(``default``, say) is consumed. In ``before_worker_boot`` it sets the worker's
``consumer_whitelist`` to its lane plus every queue declared so far that is not another lane;
each queue declared later (``before_declare_queue``, which runs before the worker adds a
consumer for it) joins the whitelist of the workers it booted, unless it is another lane. A
worker given queues (``dramatiq --queues``, ``JobRunner.start()``, which consumes its lane
only) keeps them. Touches no Redis key; no message hooks.
"""

from __future__ import annotations

from dramatiq.broker import Broker
from dramatiq.common import q_name
from dramatiq.middleware import Middleware
from dramatiq.worker import Worker

from .settings import LANES, lane_queue


class Lane(Middleware):
    def __init__(self, queue_prefix: str, lane: str) -> None:
        self.queue_name = lane_queue(queue_prefix, lane)
        #: the queues this lane's workers leave alone: the dataset's other lanes
        self.other_lanes = frozenset(lane_queue(queue_prefix, other) for other in LANES) - {
            self.queue_name
        }
        self._workers: list[Worker] = []

    def consumes(self, queue_name: str) -> bool:
        """Whether a worker of this lane that was given no queues consumes ``queue_name``."""
        return q_name(queue_name) not in self.other_lanes

    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        if worker.consumer_whitelist:
            return
        declared = broker.get_declared_queues()
        worker.consumer_whitelist = {self.queue_name} | {
            q_name(queue) for queue in declared if self.consumes(queue)
        }
        self._workers.append(worker)

    def before_declare_queue(self, broker: Broker, queue_name: str) -> None:
        if not self.consumes(queue_name):
            return
        for worker in self._workers:
            assert worker.consumer_whitelist
            worker.consumer_whitelist.add(q_name(queue_name))

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self._workers = [each for each in self._workers if each is not worker]
