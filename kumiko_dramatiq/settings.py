"""Every setting of a runner, validated in one place.

:class:`Settings` is what ``JobRunner(...)`` resolves its arguments into: an argument given
explicitly wins, else its ``KUMIKO_*`` variable (read by :mod:`kumiko_dramatiq.environment`,
the one module that reads the environment), else the default below. Validation errors are
:class:`~kumiko_dramatiq.errors.JobConfigError` naming the setting and the value.

================================ ============================== ===============================
setting                          variable                       default
================================ ============================== ===============================
``redis_url``                    ``KUMIKO_REDIS_URL``           ``redis://127.0.0.1:6379/0``
``queue_prefix``                 ``KUMIKO_QUEUE_PREFIX``        ``kumiko``
``lane``                         ``KUMIKO_LANE``                ``worker``
``heartbeat_timeout_ms``         ``KUMIKO_HEARTBEAT_TIMEOUT_MS`` 60 000
``maintenance_chance``           ``KUMIKO_MAINTENANCE_CHANCE``  1 000 (per million calls)
``lock_ttl_ms``                  ``KUMIKO_LOCK_TTL_MS``         30 000 (at least 100)
``idle_wait_ms``                 ``KUMIKO_IDLE_WAIT_MS``        200
``max_deliveries``               ``KUMIKO_MAX_DELIVERIES``      5
``max_payload_bytes``            ``KUMIKO_MAX_PAYLOAD_BYTES``   1 048 576 (1 MiB)
``max_result_bytes``             ``KUMIKO_MAX_RESULT_BYTES``    1 048 576 (1 MiB)
``log_payloads``                                                ``False``
``history_cap``                  ``KUMIKO_HISTORY_CAP``         100 000 run records
``idempotency_ttl_s``            ``KUMIKO_IDEMPOTENCY_TTL_S``   86 400 (a day)
``record_payloads``                                             ``False``
``metrics_port``                 ``KUMIKO_METRICS_PORT``        ``None`` (no metrics)
``worker_threads``                                              8
``boot_redis_timeout_ms``                                       5 000
``sequential_retry_delay_ms``                                   1 000
``timeout_check_ms``                                            1 000
``retention``                                                   ``Retention()``
``run_scheduler``                                               ``False``
``shards``                       ``KUMIKO_SHARDS``              1 (from 1 to 64)
================================ ============================== ===============================
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field, fields
from typing import Any, Final

from kumiko_dramatiq.broker.broker import MAINTENANCE_SCALE
from kumiko_dramatiq.broker.keys import ClusterPrefix
from kumiko_dramatiq.broker.urls import parse as parse_url
from kumiko_dramatiq.broker.urls import url_problem
from kumiko_dramatiq.errors import JobConfigError, redact_url
from kumiko_dramatiq.limits import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_DURATION_MS,
    TOO_LARGE,
    is_strict_int,
)
from kumiko_dramatiq.options import LANES, Lane, Retention, lane_queue

#: What a queue prefix must match (it becomes part of queue names and Redis keys).
#: The most shards a dataset may be spread over.
MAX_SHARDS: Final = 64

PREFIX_PATTERN: Final = re.compile(r"[A-Za-z_][A-Za-z0-9._-]*")

#: Below this a lease renewer (every TTL/3) would approach a busy loop.
MIN_LOCK_TTL_MS: Final = 100


class Unset(enum.Enum):
    """The default of a ``JobRunner`` setting argument: not given, so its ``KUMIKO_*``
    variable applies if set, else the default. (``None`` is a value, and an invalid one.)"""

    UNSET = "unset"


UNSET: Final = Unset.UNSET


@dataclass(frozen=True)
class Settings:
    """A runner's resolved, validated settings (see the module docstring)."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    queue_prefix: str = "kumiko"
    lane: Lane = "worker"
    #: A worker silent this long is dead; Dramatiq's maintenance then puts its unacked
    #: messages back on their queue.
    heartbeat_timeout_ms: int = 60_000
    #: Per million broker calls: the chance that a call also runs that maintenance.
    maintenance_chance: int = 1_000
    #: Lease of a sequential job's lock: how long a dead worker's lock outlives it.
    lock_ttl_ms: int = 30_000
    #: The longest an idle consumer or worker thread waits before looking again: it bounds
    #: how late an idle worker notices new work and how long ``stop()`` takes.
    idle_wait_ms: int = 200
    #: A message whose worker dies while running it this many times in a row is
    #: dead-lettered ("worker died during N deliveries"); a crash is not a failed attempt.
    max_deliveries: int = 5
    #: The largest payload ``dispatch`` and ``handle_event`` accept, JSON-encoded.
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    #: The largest value a job that keeps its result may return, JSON-encoded.
    max_result_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    #: Whether log lines about a run may show its payload (they never do by default).
    log_payloads: bool = False
    #: The most run records the history keeps; beyond it the oldest go, completed first.
    history_cap: int = 100_000
    #: Whether run records keep the payload of their message.
    record_payloads: bool = False
    #: How long a dispatch's ``idempotency_key`` stands for its first dispatch (s).
    idempotency_ttl_s: int = 86_400
    #: The port every worker process (and the scheduler) serves Prometheus metrics on
    #: (:mod:`kumiko_dramatiq.middleware.metrics`; needs ``kumiko_dramatiq[metrics]``);
    #: ``None``: none.
    metrics_port: int | None = None
    worker_threads: int = 8
    boot_redis_timeout_ms: int = 5_000
    sequential_retry_delay_ms: int = 1_000
    #: How often Dramatiq's ``TimeLimit`` checks running handlers against ``timeout_ms``.
    timeout_check_ms: int = 1_000
    retention: Retention = field(default_factory=Retention)
    run_scheduler: bool = False
    #: How many slots the dataset is spread over (:mod:`kumiko_dramatiq.shards`); every
    #: process of a dataset uses the same number (checked at start).
    shards: int = 1
    #: Which of them this runner serves: set by ``JobRunner`` for the runners of shards 1 to
    #: ``shards - 1`` it builds (their queue prefix is :func:`~kumiko_dramatiq.shards.routing.
    #: shard_prefix`), never by hand.
    shard: int = 0

    def __post_init__(self) -> None:
        problem = redis_url_problem(self.redis_url)
        if problem is not None:
            raise JobConfigError(None, "redis_url", problem, redact_url(self.redis_url))
        _check(
            isinstance(self.queue_prefix, str) and PREFIX_PATTERN.fullmatch(self.queue_prefix),
            "queue_prefix",
            f"must match {PREFIX_PATTERN.pattern}",
            self.queue_prefix,
        )
        if parse_url(self.redis_url).is_cluster and not isinstance(
            self.queue_prefix, ClusterPrefix
        ):
            object.__setattr__(self, "queue_prefix", ClusterPrefix(self.queue_prefix))
        _check(self.lane in LANES, "lane", 'must be "worker" or "api"', self.lane)
        for name in (
            "heartbeat_timeout_ms",
            "idle_wait_ms",
            "worker_threads",
            "boot_redis_timeout_ms",
            "sequential_retry_delay_ms",
            "timeout_check_ms",
            "max_deliveries",
            "max_payload_bytes",
            "max_result_bytes",
            "history_cap",
            "idempotency_ttl_s",
        ):
            value = getattr(self, name)
            _check(is_strict_int(value) and value > 0, name, "must be a positive integer", value)
            _check(not name.endswith("_ms") or value <= MAX_DURATION_MS, name, TOO_LARGE, value)
            _check(
                not name.endswith("_s") or value * 1000 <= MAX_DURATION_MS, name, TOO_LARGE, value
            )
        _check(
            is_strict_int(self.maintenance_chance)
            and 0 <= self.maintenance_chance <= MAINTENANCE_SCALE,
            "maintenance_chance",
            f"must be an integer from 0 to {MAINTENANCE_SCALE}",
            self.maintenance_chance,
        )
        _check(
            is_strict_int(self.lock_ttl_ms) and self.lock_ttl_ms >= MIN_LOCK_TTL_MS,
            "lock_ttl_ms",
            f"must be an integer >= {MIN_LOCK_TTL_MS}",
            self.lock_ttl_ms,
        )
        _check(self.lock_ttl_ms <= MAX_DURATION_MS, "lock_ttl_ms", TOO_LARGE, self.lock_ttl_ms)
        _check(
            isinstance(self.retention, Retention),
            "retention",
            "must be a Retention",
            self.retention,
        )
        _check(
            self.metrics_port is None
            or (is_strict_int(self.metrics_port) and 0 < self.metrics_port < 65536),
            "metrics_port",
            "must be a port number from 1 to 65535, or None",
            self.metrics_port,
        )
        _check(
            is_strict_int(self.shards) and 0 < self.shards <= MAX_SHARDS,
            "shards",
            f"must be an integer from 1 to {MAX_SHARDS}",
            self.shards,
        )
        _check(
            is_strict_int(self.shard) and 0 <= self.shard < self.shards,
            "shard",
            f"must be an integer from 0 to {self.shards - 1}",
            self.shard,
        )
        _check(
            isinstance(self.run_scheduler, bool),
            "run_scheduler",
            "must be a bool",
            self.run_scheduler,
        )

    @property
    def queue_name(self) -> str:
        """The queue of this runner's lane."""
        return lane_queue(self.queue_prefix, self.lane)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def redis_url_problem(url: Any) -> str | None:
    """Why ``url`` is not a usable Redis URL, or ``None``: the forms and options of
    :mod:`kumiko_dramatiq.broker.connection` (``redis://``, ``rediss://``, ``unix://``,
    ``redis+sentinel://``), with a host (or a socket path), a valid port and database number."""
    return url_problem(url)


def _check(ok: Any, name: str, problem: str, value: Any) -> None:
    if not ok:
        raise JobConfigError(None, name, problem, value)
