"""The state every subject of the admin API shares: one dataset's broker, registry and settings.

:class:`AdminBase` holds what :class:`~kumiko_dramatiq.ops.admin.Admin` is built from (its
Redis client, queue prefix and run history) and the little that several subjects read: the
lane queues and the capped jobs. Each subject is a class of its own on top of it (its module
says which); ``Admin`` inherits them all.
"""

from __future__ import annotations

import redis

from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.ops.history import RunHistory
from kumiko_dramatiq.options import LANES, lane_queue
from kumiko_dramatiq.registry import JobDefinition, Registry
from kumiko_dramatiq.settings import Settings


class AdminBase:
    """One dataset (``broker``'s Redis and queue prefix), as the admin API sees it."""

    def __init__(self, broker: KumikoBroker, registry: Registry, settings: Settings) -> None:
        self.broker = broker
        self.registry = registry
        self.settings = settings
        self.client: redis.Redis = broker.client
        self.prefix = settings.queue_prefix
        self.history = RunHistory(broker.client, broker.lua, self.prefix)

    @property
    def lane_queues(self) -> list[str]:
        return [lane_queue(self.prefix, lane) for lane in LANES]

    def capped_jobs(self) -> list[JobDefinition]:
        """The declared jobs with a cap (``max_running`` or ``rate_limit``)."""
        return [job for job in self.registry.jobs.values() if job.is_capped]
