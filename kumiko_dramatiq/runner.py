"""``JobRunner``: builds a runner's broker, declares its actors, runs its worker.

One runner = one ``KumikoBroker`` (never Dramatiq's global broker), one
middleware chain (:func:`build_middleware`, shared with ``dramatiq
kumiko_dramatiq.app``), one actor per job named by its qualified name on the
queue ``f"{queue_prefix}-{run_in}"``, plus a wrapper actor per per-tenant job.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dramatiq
import redis
from dramatiq.middleware import Middleware, TimeLimit
from dramatiq.worker import Worker

from .actors import declare_actors
from .broker import KumikoBroker, make_connection_pool
from .dedup import dispatch_with_key, event_dedup_keys
from .errors import JobConfigError, PayloadError, RedisUnavailableError, UnknownJobError
from .messages import build_message, validate_payload
from .middleware.boot import Boot
from .middleware.dedup import Dedup
from .middleware.execution import Executions
from .middleware.hooks import Hooks
from .middleware.lane import Lane
from .middleware.retries import Retries
from .middleware.sequential import Sequential
from .options import Retention
from .registry import JobDefinition, Registry
from .runtime import FailedHook, HookSet, Runtime, StartHook, TenantResolver

logger = logging.getLogger("kumiko_dramatiq")

_PREFIX_RE = re.compile(r"[A-Za-z_][A-Za-z0-9._-]*")
_LANES = ("worker", "api")

#: Dramatiq's crash recovery: a worker silent this long is dead and its
#: unacked messages go back to their queue. Override with
#: ``KUMIKO_HEARTBEAT_TIMEOUT_MS`` (tests and soak runs shrink it).
DEFAULT_HEARTBEAT_TIMEOUT_MS = 60_000
#: Chance per million broker calls that a call also runs that recovery;
#: ``KUMIKO_MAINTENANCE_CHANCE`` overrides it.
DEFAULT_MAINTENANCE_CHANCE = 1_000
#: How long an idle worker thread or consumer waits before looking again: it
#: bounds how late an idle worker notices new work and how long ``stop()``
#: takes. Dramatiq's default is 1000 ms.
WORKER_TIMEOUT_MS = 200


def build_middleware(runtime: Runtime, *, timeout_check_ms: int = 1_000) -> list[Middleware]:
    """The one middleware chain of a kumiko broker, in ``before_*`` order."""
    return [
        Lane(runtime.queue_name),
        Boot(runtime),
        Executions(runtime),
        Retries(runtime),
        Sequential(runtime),
        Dedup(runtime),
        Hooks(runtime),
        TimeLimit(time_limit=float("inf"), interval=timeout_check_ms),
    ]


class JobRunner:
    """Dispatches jobs and, once started, runs the jobs of one lane.

    Construction validates everything and opens no connection. ``dispatch``
    and ``handle_event`` work without ``start()`` (producer only).
    """

    def __init__(
        self,
        registry: Registry,
        *,
        redis_url: str = "redis://127.0.0.1:6379/0",
        lane: str = "worker",
        queue_prefix: str = "kumiko",
        context: Any = None,
        get_active_tenant_ids: TenantResolver | None = None,
        on_job_start: StartHook | None = None,
        on_job_complete: StartHook | None = None,
        on_job_failed: FailedHook | None = None,
        retention: Retention | None = None,
        worker_threads: int = 8,
        run_scheduler: bool = False,
        boot_redis_timeout_ms: int = 5_000,
        sequential_retry_delay_ms: int = 1_000,
    ) -> None:
        if not isinstance(registry, Registry):
            raise JobConfigError(None, "registry", "must be a Registry", registry)
        if lane not in _LANES:
            raise JobConfigError(None, "lane", 'must be "worker" or "api"', lane)
        if not isinstance(queue_prefix, str) or not _PREFIX_RE.fullmatch(queue_prefix):
            raise JobConfigError(
                None, "queue_prefix", "must match [A-Za-z_][A-Za-z0-9._-]*", queue_prefix
            )
        if not isinstance(redis_url, str) or "://" not in redis_url:
            raise JobConfigError(None, "redis_url", "must be a redis:// URL", redis_url)
        retention = Retention() if retention is None else retention
        if not isinstance(retention, Retention):
            raise JobConfigError(None, "retention", "must be a Retention", retention)
        for name, value in (
            ("worker_threads", worker_threads),
            ("boot_redis_timeout_ms", boot_redis_timeout_ms),
            ("sequential_retry_delay_ms", sequential_retry_delay_ms),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise JobConfigError(None, name, "must be a positive integer", value)
        for name, hook in (
            ("on_job_start", on_job_start),
            ("on_job_complete", on_job_complete),
            ("on_job_failed", on_job_failed),
            ("get_active_tenant_ids", get_active_tenant_ids),
        ):
            if hook is not None and not callable(hook):
                raise JobConfigError(None, name, "must be callable or None", hook)
        _check_retention_covers_retries(registry, retention)

        self.registry = registry
        self.redis_url = redis_url
        self.lane = lane
        self.queue_prefix = queue_prefix
        self.retention = retention
        self.worker_threads = worker_threads
        self.run_scheduler = run_scheduler
        self.boot_redis_timeout_ms = boot_redis_timeout_ms
        self.runtime = Runtime(
            registry=registry,
            queue_prefix=queue_prefix,
            lane=lane,
            app=context,
            hooks=HookSet(on_job_start, on_job_complete, on_job_failed),
            retention=retention,
            get_active_tenant_ids=get_active_tenant_ids,
            sequential_retry_delay_ms=sequential_retry_delay_ms,
        )
        self.broker = KumikoBroker(
            middleware=build_middleware(self.runtime),
            client=redis.Redis(
                connection_pool=make_connection_pool(redis_url, boot_redis_timeout_ms / 1000)
            ),
            heartbeat_timeout=_env_int("KUMIKO_HEARTBEAT_TIMEOUT_MS", DEFAULT_HEARTBEAT_TIMEOUT_MS),
            maintenance_chance=_env_int("KUMIKO_MAINTENANCE_CHANCE", DEFAULT_MAINTENANCE_CHANCE),
            dead_message_ttl=retention.failed_age_s * 1000,
            queue_prefix=queue_prefix,
            completed_ttl_ms=retention.completed_age_s * 1000,
            moved_marker_ttl_ms=retention.completed_age_s * 1000,
        )
        self.runtime.attach(self.broker)
        declare_actors(self.broker, self.runtime)
        self._worker: Worker | None = None
        self._scheduler: Any = None
        self._started = False
        self._stopped = False

    # -- producing --------------------------------------------------------
    def dispatch(
        self,
        job_name: str,
        payload: dict[str, Any] | None = None,
        *,
        dedup_key: str | None = None,
        delay_ms: int | None = None,
    ) -> str:
        """Enqueue one run of ``job_name``; return its message id.

        For a per-tenant job this is the wrapper's id. Raises
        ``UnknownJobError`` or ``PayloadError`` before anything is enqueued,
        and ``RedisUnavailableError`` when Redis does not answer.
        """
        job = self._job(job_name)
        body = validate_payload(job.qualified_name, payload)
        if delay_ms is not None and (
            not isinstance(delay_ms, int) or isinstance(delay_ms, bool) or delay_ms < 0
        ):
            raise PayloadError(job.qualified_name, "delay_ms", "must be an integer >= 0", delay_ms)
        if dedup_key is not None:
            if not isinstance(dedup_key, str) or not dedup_key:
                raise PayloadError(
                    job.qualified_name, "dedup_key", "must be a non-empty string", dedup_key
                )
            with self._redis("dispatching " + job.qualified_name):
                return dispatch_with_key(
                    self.runtime, job, body, dedup_key, trigger="manual", delay_ms=delay_ms
                )
        message = build_message(job, body, queue_prefix=self.queue_prefix, trigger="manual")
        with self._redis("dispatching " + job.qualified_name):
            self.broker.enqueue(message, delay=delay_ms)
        return str(message.message_id)

    def handle_event(self, event_name: str, payload: dict[str, Any] | None = None) -> list[str]:
        """Dispatch every job whose trigger is ``Event(event_name)``; return their ids.

        The payload, and the dedup key of every job whose ``Event`` names a
        key function, are checked for all of them before any is enqueued; a
        keyed job goes through its dedup key. An event no job listens to
        returns ``[]``.
        """
        jobs = self.registry.jobs_for_event(event_name)
        if not jobs:
            return []
        body = validate_payload(f"event {event_name}", payload)
        dedup_keys = event_dedup_keys(jobs, body)
        ids: list[str] = []
        for job, dedup_key in zip(jobs, dedup_keys, strict=True):
            with self._redis(f"handling event {event_name}"):
                if dedup_key is not None:
                    ids.append(
                        dispatch_with_key(
                            self.runtime, job, body, dedup_key, trigger="event", delay_ms=None
                        )
                    )
                    continue
                message = build_message(job, body, queue_prefix=self.queue_prefix, trigger="event")
                self.broker.enqueue(message)
            ids.append(str(message.message_id))
        return ids

    # -- consuming --------------------------------------------------------
    def start(self) -> None:
        """Boot gates, boot-once enqueue, then consume this runner's lane."""
        if self._started:
            raise RuntimeError("this JobRunner was started already; build a new one")
        self._check_can_consume()
        self.wait_for_redis()
        self._started = True
        boot = self._middleware(Boot)
        boot.driven_by_runner = True
        self.broker.emit_after("process_boot")
        try:
            boot.run(self.broker)
        except BaseException:
            self._close()
            raise
        self._worker = Worker(
            self.broker,
            queues={self.runtime.queue_name},
            worker_threads=self.worker_threads,
            worker_timeout=WORKER_TIMEOUT_MS,
        )
        self._worker.start()
        if self.run_scheduler:
            from .scheduler import Scheduler

            self._scheduler = Scheduler(self)
            self._scheduler.start()
        logger.info(
            "kumiko runner consuming %s (%d threads)", self.runtime.queue_name, self.worker_threads
        )

    def stop(self, timeout_s: float = 30) -> None:
        """Stop consuming, wait up to ``timeout_s`` for running handlers, close.

        Idempotent; safe on a runner that never started.
        """
        if self._stopped:
            return
        self._stopped = True
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.stop()
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop(timeout=int(timeout_s * 1000))
        self._close()

    def __enter__(self) -> JobRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_for_redis(self) -> None:
        """Ping Redis until it answers; ``RedisUnavailableError`` after
        ``boot_redis_timeout_ms``."""
        deadline = time.monotonic() + self.boot_redis_timeout_ms / 1000
        last_error: BaseException | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RedisUnavailableError(self.redis_url, "starting the runner", last_error)
            probe = redis.Redis.from_url(
                self.redis_url,
                socket_connect_timeout=remaining,
                socket_timeout=remaining,
                retry=None,
            )
            try:
                probe.ping()
                return
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                last_error = exc
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            finally:
                probe.close()

    # -- internals --------------------------------------------------------
    def _job(self, job_name: str) -> JobDefinition:
        try:
            return self.registry.jobs[job_name]
        except (KeyError, TypeError):
            raise UnknownJobError(str(job_name), list(self.registry.jobs)) from None

    @contextmanager
    def _redis(self, action: str) -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise RedisUnavailableError(self.redis_url, action, exc) from exc

    def _middleware(self, kind: type[Any]) -> Any:
        for middleware in self.broker.middleware:
            if isinstance(middleware, kind):
                return middleware
        raise LookupError(kind.__name__)

    def _check_can_consume(self) -> None:
        for middleware in self.broker.middleware:
            if isinstance(middleware, dramatiq.middleware.Retries):
                raise JobConfigError(
                    None,
                    "broker middleware",
                    "must not include dramatiq's Retries: kumiko retries its own messages",
                )
        check_lane_can_run(self.runtime)

    def _close(self) -> None:
        self.runtime.loop.stop()
        self.broker.client.connection_pool.disconnect()


def check_lane_can_run(runtime: Runtime) -> None:
    """A worker of a lane with per-tenant jobs needs ``get_active_tenant_ids``."""
    if runtime.get_active_tenant_ids is not None:
        return
    for job in runtime.registry.jobs.values():
        if job.options.per_tenant and job.options.run_in == runtime.lane:
            raise JobConfigError(
                job.qualified_name,
                "per_tenant",
                "needs JobRunner(get_active_tenant_ids=...) on the workers of its lane",
            )


def _check_retention_covers_retries(registry: Registry, retention: Retention) -> None:
    limit_ms = retention.completed_age_s * 1000
    for job in registry.jobs.values():
        if not job.options.per_tenant:
            continue
        window_ms = job.options.retry_window_ms()
        if window_ms >= limit_ms:
            raise JobConfigError(
                job.qualified_name,
                "retries/backoff",
                f"give a retry window of {window_ms} ms, not below "
                f"retention.completed_age_s ({retention.completed_age_s} s): child dedup "
                "records would expire while the wrapper can still retry",
            )


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise JobConfigError(None, name, "must be an integer", raw) from None
