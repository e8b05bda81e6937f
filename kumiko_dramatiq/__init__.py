"""kumiko_dramatiq: jobs declared in features, run on Dramatiq and Redis.

Public API only; see the README and docs/ for the contract of every name exported here.
Declaring jobs (``Feature``, ``Registry``, the options, ``Cron``, the errors) loads neither
redis-py nor Dramatiq's brokers: an app module that only declares jobs imports fast.
``JobRunner`` and the run-history types load the rest on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kumiko_dramatiq.context import JobContext, JobMeta
from kumiko_dramatiq.cron import Cron
from kumiko_dramatiq.errors import (
    JobConfigError,
    JobFailedError,
    KumikoError,
    NotFoundError,
    PayloadError,
    RedisAccessError,
    RedisUnavailableError,
    ResultError,
    ResultPending,
    UnknownJobError,
)
from kumiko_dramatiq.options import (
    Backoff,
    Event,
    Manual,
    RateLimit,
    Retention,
    build_message_options,
)
from kumiko_dramatiq.registry import Feature, JobDefinition, Registry

if TYPE_CHECKING:
    from kumiko_dramatiq.ops.history import JobRun
    from kumiko_dramatiq.ops.stats import JobStats
    from kumiko_dramatiq.ops.waiting import QueuedMessage
    from kumiko_dramatiq.runner import JobRunner
    from kumiko_dramatiq.schedules.model import Schedule
    from kumiko_dramatiq.workflows.batches import BatchResult, BatchStatus

#: Public names whose modules load redis-py: imported on first use.
_LAZY = {
    "JobRunner": "kumiko_dramatiq.runner",
    "JobRun": "kumiko_dramatiq.ops.history",
    "JobStats": "kumiko_dramatiq.ops.stats",
    "QueuedMessage": "kumiko_dramatiq.ops.waiting",
    "BatchResult": "kumiko_dramatiq.workflows.batches",
    "BatchStatus": "kumiko_dramatiq.workflows.batches",
    "Schedule": "kumiko_dramatiq.schedules.model",
}


if not TYPE_CHECKING:  # type checkers see the imports above, and no catch-all

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'kumiko_dramatiq' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value


__all__ = [
    "Backoff",
    "BatchResult",
    "BatchStatus",
    "Cron",
    "Event",
    "Feature",
    "JobConfigError",
    "JobContext",
    "JobDefinition",
    "JobFailedError",
    "JobMeta",
    "JobRun",
    "JobRunner",
    "JobStats",
    "KumikoError",
    "Manual",
    "NotFoundError",
    "PayloadError",
    "QueuedMessage",
    "RateLimit",
    "RedisAccessError",
    "RedisUnavailableError",
    "Registry",
    "ResultError",
    "ResultPending",
    "Retention",
    "Schedule",
    "UnknownJobError",
    "build_message_options",
]
