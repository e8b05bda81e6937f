"""kumiko_dramatiq: jobs declared in features, run on Dramatiq and Redis.

Public API only; see the README for the contract of every name exported here.
"""

from __future__ import annotations

from .context import JobContext, JobMeta
from .cron import Cron
from .errors import (
    JobConfigError,
    KumikoError,
    PayloadError,
    RedisUnavailableError,
    UnknownJobError,
)
from .options import Backoff, Event, Manual, Retention
from .registry import Feature, JobDefinition, Registry
from .retries import build_message_options
from .runner import JobRunner

__all__ = [
    "Backoff",
    "Cron",
    "Event",
    "Feature",
    "JobConfigError",
    "JobContext",
    "JobDefinition",
    "JobMeta",
    "JobRunner",
    "KumikoError",
    "Manual",
    "PayloadError",
    "RedisUnavailableError",
    "Registry",
    "Retention",
    "UnknownJobError",
    "build_message_options",
]
