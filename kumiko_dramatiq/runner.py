"""``JobRunner``: builds a runner's broker, declares its actors, runs its worker.

One runner = one ``KumikoBroker`` (never Dramatiq's global broker), one middleware chain
(:func:`kumiko_dramatiq.middleware.build_middleware`, shared with
``dramatiq kumiko_dramatiq.app``), one actor per job
named by its qualified name on the queue ``f"{queue_prefix}-{run_in}"``, plus a wrapper actor
per per-tenant job. Every setting is a validated argument (:mod:`kumiko_dramatiq.settings`);
an argument not given falls back to its ``KUMIKO_*`` variable, then to its default.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar, cast

import redis
from dramatiq.message import Message
from dramatiq.worker import Worker
from pydantic import BaseModel

from kumiko_dramatiq.aio.producer import LoopClients, aresult, asynchronous
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.acl import check_server, cluster_problem
from kumiko_dramatiq.broker.broker import KumikoBroker, make_connection_pool
from kumiko_dramatiq.broker.carrier import CarriedRedis
from kumiko_dramatiq.broker.connection import SentinelPool
from kumiko_dramatiq.broker.connection import client as redis_client
from kumiko_dramatiq.broker.faults import kumiko_error
from kumiko_dramatiq.broker.tls import scheme_problem, tls_problem
from kumiko_dramatiq.environment import resolve_settings
from kumiko_dramatiq.errors import (
    JobConfigError,
    NotFoundError,
    NotRedisError,
    PayloadError,
    RedisAccessError,
    RedisUnavailableError,
    UnknownJobError,
)
from kumiko_dramatiq.limits import (
    check_debounce,
    check_dedup_key,
    check_delay_ms,
    check_fair_key,
    check_priority,
)
from kumiko_dramatiq.messages import build_message
from kumiko_dramatiq.middleware import build_middleware
from kumiko_dramatiq.middleware.boot import Boot
from kumiko_dramatiq.middleware.dedup import (
    Dedup,
    dispatch_debounced,
    dispatch_many_with_keys,
    dispatch_with_key,
    event_dedup_keys,
)
from kumiko_dramatiq.middleware.presence import Presence
from kumiko_dramatiq.middleware.retries import check_no_dramatiq_retries
from kumiko_dramatiq.ops.admin import (
    PURGE_WALKS,
    Admin,
)
from kumiko_dramatiq.ops.draining import Drain
from kumiko_dramatiq.ops.history import STATUSES, JobRun, RunHistory, RunStatus, run_ttls_ms
from kumiko_dramatiq.ops.stats import MAX_HOURS, JobStats, read_stats
from kumiko_dramatiq.ops.waiting import WAITING_STATES, QueuedMessage
from kumiko_dramatiq.options import Retention, retry_window_ms
from kumiko_dramatiq.payloads import event_payload, payload_to_enqueue
from kumiko_dramatiq.registry import JobDefinition, Registry
from kumiko_dramatiq.scheduler import Scheduler
from kumiko_dramatiq.schedules import Schedules
from kumiko_dramatiq.settings import UNSET, Settings, Unset
from kumiko_dramatiq.shards.admin import ShardedAdmin, ShardedHistory
from kumiko_dramatiq.shards.fleet import Fleet
from kumiko_dramatiq.shards.routing import new_id_in, shard_prefix
from kumiko_dramatiq.shards.schedules import ShardedSchedules
from kumiko_dramatiq.worker.actors import declare_actors
from kumiko_dramatiq.worker.execution import KumikoMessages
from kumiko_dramatiq.worker.logs import install_log_filter
from kumiko_dramatiq.worker.runtime import FailedHook, HookSet, Runtime, StartHook, TenantResolver
from kumiko_dramatiq.workflows.batches import BATCH_STATES, BatchStatus, Item
from kumiko_dramatiq.workflows.results import EVERY_RESULT, MAX_RESULT_WAIT_S, Results

logger = logging.getLogger("kumiko_dramatiq")

#: How many messages ``dispatch_many`` writes per Lua call.
DISPATCH_BATCH = 500


P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Many:
    """The checked arguments of one ``dispatch_many``: one body (and key) per message."""

    job: JobDefinition
    bodies: list[dict[str, Any]]
    delay_ms: int | None
    priority: int | None
    fair_key: str | None
    dedup_keys: list[str] | None
    idempotency_keys: list[str] | None

    def key(self, index: int) -> str | None:
        """The dedup or idempotency key of message ``index``, if it has one."""
        given = self.dedup_keys if self.dedup_keys is not None else self.idempotency_keys
        return None if given is None else given[index]

    def part(self, indexes: Sequence[int]) -> Many:
        """The same call for the messages at ``indexes`` only."""

        def pick(values: list[str] | None) -> list[str] | None:
            return None if values is None else [values[i] for i in indexes]

        return replace(
            self,
            bodies=[self.bodies[i] for i in indexes],
            dedup_keys=pick(self.dedup_keys),
            idempotency_keys=pick(self.idempotency_keys),
        )


def _fronted(
    method: Callable[Concatenate[JobRunner, P], R],
) -> Callable[Concatenate[JobRunner, P], R]:
    """A ``JobRunner`` method that, on a dataset of several shards, is its
    :class:`~kumiko_dramatiq.shards.fleet.Fleet`'s method of the same name (which routes the
    call to a shard, or makes it on each and merges the answers)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: JobRunner, /, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._fleet is None:
            return method(self, *args, **kwargs)
        return cast(R, getattr(self._fleet, name)(*args, **kwargs))

    return call


def _reads_admin(
    method: Callable[Concatenate[Admin, P], R], action: str, doc: str
) -> Callable[Concatenate[JobRunner, P], R]:
    """A ``JobRunner`` method that is ``method`` of its :class:`Admin`: a ``job`` it is given
    (first argument or keyword) must be declared, a ``limit`` must be an int from 1 to
    :data:`MAX_LISTED` (``ValueError``), a Redis failure while ``action`` becomes
    ``RedisUnavailableError``."""

    def read(self: JobRunner, /, *args: P.args, **kwargs: P.kwargs) -> R:
        job = kwargs.get("job", args[0] if args else None)
        if job is not None:
            self._job(job)  # type: ignore[arg-type]
        if "limit" in kwargs:
            _check_limit(kwargs["limit"], MAX_LISTED)
        if self._fleet is not None:
            return cast(R, getattr(self._fleet, method.__name__)(*args, **kwargs))
        with self._redis(action):
            return method(self.admin, *args, **kwargs)

    read.__name__ = method.__name__
    read.__qualname__ = f"JobRunner.{method.__name__}"
    read.__doc__ = doc
    return read


class JobRunner:
    """Dispatches jobs and, once started, runs the jobs of one lane.

    Construction validates everything and opens no connection. ``dispatch``
    and ``handle_event`` work without ``start()`` (producer only).
    """

    def __init__(
        self,
        registry: Registry,
        *,
        redis_url: str | Unset = UNSET,
        lane: str | Unset = UNSET,
        queue_prefix: str | Unset = UNSET,
        context: Any = None,
        get_active_tenant_ids: TenantResolver | None = None,
        on_job_start: StartHook | None = None,
        on_job_complete: StartHook | None = None,
        on_job_failed: FailedHook | None = None,
        retention: Retention | None = None,
        worker_threads: int | Unset = UNSET,
        run_scheduler: bool | Unset = UNSET,
        boot_redis_timeout_ms: int | Unset = UNSET,
        sequential_retry_delay_ms: int | Unset = UNSET,
        lock_ttl_ms: int | Unset = UNSET,
        heartbeat_timeout_ms: int | Unset = UNSET,
        maintenance_chance: int | Unset = UNSET,
        idle_wait_ms: int | Unset = UNSET,
        timeout_check_ms: int | Unset = UNSET,
        max_deliveries: int | Unset = UNSET,
        max_payload_bytes: int | Unset = UNSET,
        log_payloads: bool | Unset = UNSET,
        history_cap: int | Unset = UNSET,
        record_payloads: bool | Unset = UNSET,
        metrics_port: int | Unset | None = UNSET,
        idempotency_ttl_s: int | Unset = UNSET,
        shards: int | Unset = UNSET,
    ) -> None:
        if not isinstance(registry, Registry):
            raise JobConfigError(None, "registry", "must be a Registry", registry)
        settings = resolve_settings(
            {
                "redis_url": redis_url,
                "lane": lane,
                "queue_prefix": queue_prefix,
                "retention": UNSET if retention is None else retention,
                "worker_threads": worker_threads,
                "run_scheduler": run_scheduler,
                "boot_redis_timeout_ms": boot_redis_timeout_ms,
                "sequential_retry_delay_ms": sequential_retry_delay_ms,
                "lock_ttl_ms": lock_ttl_ms,
                "heartbeat_timeout_ms": heartbeat_timeout_ms,
                "maintenance_chance": maintenance_chance,
                "idle_wait_ms": idle_wait_ms,
                "timeout_check_ms": timeout_check_ms,
                "max_deliveries": max_deliveries,
                "max_payload_bytes": max_payload_bytes,
                "log_payloads": log_payloads,
                "history_cap": history_cap,
                "record_payloads": record_payloads,
                "metrics_port": metrics_port,
                "idempotency_ttl_s": idempotency_ttl_s,
                "shards": shards,
            }
        )
        for name, hook in (
            ("on_job_start", on_job_start),
            ("on_job_complete", on_job_complete),
            ("on_job_failed", on_job_failed),
            ("get_active_tenant_ids", get_active_tenant_ids),
        ):
            if hook is not None and not callable(hook):
                raise JobConfigError(None, name, "must be callable or None", hook)
        _check_retention_covers_retries(registry, settings.retention)

        install_log_filter()
        hooks = HookSet(on_job_start, on_job_complete, on_job_failed)
        #: the runners of the dataset's shards, when it has more than one (``shards=N``)
        self._fleet: Fleet | None = None
        if settings.shards == 1:
            self._assemble(registry, settings, context, hooks, get_active_tenant_ids)
            return
        runners = [
            JobRunner._of_shard(
                registry,
                replace(settings, queue_prefix=shard_prefix(settings.queue_prefix, i), shard=i),
                context,
                hooks,
                get_active_tenant_ids,
            )
            for i in range(settings.shards)
        ]
        # What this runner does not route over the shards (its broker, its registry, the
        # reads that are shard 0's: ``history``, ``admin``, ``schedules``) is shard 0's.
        self.__dict__.update(runners[0].__dict__)
        self._fleet = Fleet(runners)

    @classmethod
    def _of_shard(
        cls,
        registry: Registry,
        settings: Settings,
        context: Any,
        hooks: HookSet,
        get_active_tenant_ids: TenantResolver | None,
    ) -> JobRunner:
        """The runner of one of the other shards of a dataset (:mod:`kumiko_dramatiq.shards`):
        a runner of its own, fronted by the runner of shard 0."""
        runner = cls.__new__(cls)
        runner._fleet = None
        runner._assemble(registry, settings, context, hooks, get_active_tenant_ids)
        return runner

    def _assemble(
        self,
        registry: Registry,
        settings: Settings,
        context: Any,
        hooks: HookSet,
        get_active_tenant_ids: TenantResolver | None,
    ) -> None:
        """Build the runner of one shard from its checked settings."""
        self.registry = registry
        self.settings = settings
        self.runtime = Runtime(
            registry=registry,
            settings=settings,
            app=context,
            hooks=hooks,
            get_active_tenant_ids=get_active_tenant_ids,
        )
        dedup = Dedup(self.runtime)
        client = CarriedRedis(
            connection_pool=make_connection_pool(
                settings.redis_url, settings.boot_redis_timeout_ms / 1000, settings.queue_prefix
            )
        )
        presence = Presence(
            client,
            settings.queue_prefix,
            settings.lane,
            settings.heartbeat_timeout_ms,
            deferred=self.runtime.deferred,
            shards=settings.shards,
        )
        self.broker = KumikoBroker(
            middleware=build_middleware(self.runtime, dedup, presence),
            client=client,
            heartbeat_timeout=settings.heartbeat_timeout_ms,
            maintenance_chance=settings.maintenance_chance,
            dead_message_ttl=settings.retention.failed_age_s * 1000,
            queue_prefix=settings.queue_prefix,
            lane=settings.lane,
            max_deliveries=settings.max_deliveries,
            run_ttls_ms=run_ttls_ms(settings),
            history_cap=settings.history_cap,
            capped_queues=frozenset(
                job.queue_name(settings.queue_prefix)
                for job in registry.jobs.values()
                if job.is_capped
            ),
            slot_ttl_ms=settings.lock_ttl_ms,
            message_policy=KumikoMessages(
                registry,
                rejected=dedup.release_rejected,
                max_payload_bytes=settings.max_payload_bytes,
            ),
        )
        self.runtime.attach(self.broker)
        declare_actors(self.broker, self.runtime)
        self._worker: Worker | None = None
        self._scheduler: Scheduler | None = None
        self._started = False
        self._stopped = False
        self._drain = Drain(self.broker, registry, settings.queue_prefix)

    # -- settings, as attributes --------------------------------------------
    @property
    def redis_url(self) -> str:
        return self.settings.redis_url

    @property
    def lane(self) -> str:
        return self.settings.lane

    @property
    def queue_prefix(self) -> str:
        return self.settings.queue_prefix

    @property
    def retention(self) -> Retention:
        return self.settings.retention

    @property
    def worker_threads(self) -> int:
        return self.settings.worker_threads

    @property
    def run_scheduler(self) -> bool:
        return self.settings.run_scheduler

    @property
    def boot_redis_timeout_ms(self) -> int:
        return self.settings.boot_redis_timeout_ms

    @property
    def shard_runners(self) -> tuple[JobRunner, ...]:
        """The runner of each shard of the dataset, shard 0 first (``shards=N``): each a
        whole runner over its own slot (:mod:`kumiko_dramatiq.shards`); this runner alone
        when the dataset has one shard."""
        return (self,) if self._fleet is None else self._fleet.shards

    # -- producing --------------------------------------------------------
    @_fronted
    def dispatch(
        self,
        job_name: str,
        payload: dict[str, Any] | BaseModel | None = None,
        *,
        dedup_key: str | None = None,
        delay_ms: int | None = None,
        idempotency_key: str | None = None,
        priority: int | None = None,
        fair_key: str | None = None,
        debounce_ms: int | None = None,
        max_wait_ms: int | None = None,
    ) -> str:
        """Enqueue one run of ``job_name``; return its message id.

        ``priority`` (0 runs first, 9 last; ``None``: the job's own) and ``fair_key`` (the key
        it takes its turn under among its lane's waiting messages; a per-tenant child's is its
        tenant, and a per-tenant wrapper's priority reaches its children) order the start.

        With ``dedup_key`` and ``debounce_ms``: while the job of that key has not started,
        each such dispatch replaces its payload and moves its start to now + ``debounce_ms``,
        never later than ``max_wait_ms`` after the first of them; all return the same id.

        With ``idempotency_key``, a dispatch of the same job with a key used within
        ``idempotency_ttl_s`` returns the first dispatch's id and enqueues nothing, whatever
        became of that message: for a caller that retries a call whose outcome it does not
        know (``RedisUnavailableError.maybe_enqueued``). Not with ``dedup_key``.

        For a per-tenant job this is the wrapper's id. A typed job (its handler takes a
        pydantic model) takes a dict or an instance of its model, validated here, and
        enqueues ``model_dump(mode="json")`` (:mod:`kumiko_dramatiq.payloads`). Raises
        ``UnknownJobError`` or ``PayloadError`` before anything is enqueued,
        and ``RedisUnavailableError`` when Redis does not answer.
        """
        job = self._job(job_name)
        name = job.qualified_name
        body = payload_to_enqueue(job, payload, max_bytes=self.settings.max_payload_bytes)
        delay_ms = check_delay_ms(name, delay_ms)
        priority = check_priority(name, priority)
        fair_key = check_fair_key(name, fair_key)
        debounce_ms, max_wait_ms = check_debounce(
            name, debounce_ms, max_wait_ms, dedup_key=dedup_key, delay_ms=delay_ms
        )
        if idempotency_key is not None:
            idempotency_key = check_dedup_key(name, "idempotency_key", idempotency_key)
            if dedup_key is not None:
                raise PayloadError(name, "idempotency_key", "cannot go with a dedup_key")
            message = self._manual(job, body, priority, fair_key)
            with self._redis("dispatching " + name):
                return self.broker.enqueue_idempotent(
                    message,
                    keys.idempotency(self.queue_prefix, name, idempotency_key),
                    self.settings.idempotency_ttl_s * 1000,
                    delay=delay_ms,
                )
        if dedup_key is not None:
            dedup_key = check_dedup_key(name, "dedup_key", dedup_key)
            with self._redis("dispatching " + job.qualified_name):
                if debounce_ms is not None:
                    return dispatch_debounced(
                        self.runtime,
                        job,
                        body,
                        dedup_key,
                        trigger="manual",
                        debounce_ms=debounce_ms,
                        max_wait_ms=max_wait_ms,
                        priority=priority,
                        fair_key=fair_key,
                    )
                return dispatch_with_key(
                    self.runtime,
                    job,
                    body,
                    dedup_key,
                    trigger="manual",
                    delay_ms=delay_ms,
                    priority=priority,
                    fair_key=fair_key,
                )
        message = self._manual(job, body, priority, fair_key)
        try:  # what ``self._redis`` does, inline: this is the hot path of a producer
            self.broker.enqueue(message, delay=delay_ms)
        except redis.RedisError as exc:
            raise kumiko_error(self.redis_url, "dispatching " + name, exc) from exc
        return str(message.message_id)

    def _manual(
        self, job: JobDefinition, body: dict[str, Any], priority: int | None, fair_key: str | None
    ) -> Message[Any]:
        """The message of one manual dispatch of ``job`` (checked arguments)."""
        return build_message(
            job,
            body,
            queue_prefix=self.queue_prefix,
            trigger="manual",
            message_id=self._new_id(),
            priority=priority,
            fair_key=fair_key,
        )

    @_fronted
    def dispatch_many(
        self,
        job_name: str,
        payloads: Iterable[dict[str, Any] | BaseModel | None],
        *,
        dedup_keys: Iterable[str] | None = None,
        delay_ms: int | None = None,
        idempotency_keys: Iterable[str] | None = None,
        priority: int | None = None,
        fair_key: str | None = None,
    ) -> list[str]:
        """Enqueue one run of ``job_name`` per payload, in order; return their message ids.

        Every payload (and dedup key: ``dedup_keys`` gives one per payload) is checked (a
        typed job's validated against its model) before anything is enqueued: a bad one
        raises ``PayloadError`` naming its index and field (``payloads[3]``,
        ``payloads[3].amount``, ``dedup_keys[3]``), and nothing is enqueued. Then the messages go
        in batches of :data:`DISPATCH_BATCH`, one Lua call each (each batch all or nothing),
        with everything ``dispatch`` gives a message: options, retries, per-tenant wrapper,
        delay, and dedup keys decided exactly as ``dispatch`` decides them (a key given twice
        stands for its first message; a live key's id comes back as in ``dispatch``).
        ``priority`` and ``fair_key``: as ``dispatch``'s, for every message.
        """
        return self._enqueue_many(
            self._checked_many(
                job_name,
                payloads,
                dedup_keys=dedup_keys,
                delay_ms=delay_ms,
                idempotency_keys=idempotency_keys,
                priority=priority,
                fair_key=fair_key,
            )
        )

    def _checked_many(
        self,
        job_name: str,
        payloads: Iterable[dict[str, Any] | BaseModel | None],
        *,
        dedup_keys: Iterable[str] | None,
        delay_ms: int | None,
        idempotency_keys: Iterable[str] | None,
        priority: int | None,
        fair_key: str | None,
    ) -> Many:
        """The arguments of :meth:`dispatch_many`, every one checked; nothing is enqueued."""
        job = self._job(job_name)
        name = job.qualified_name
        max_bytes = self.settings.max_payload_bytes
        bodies = [
            payload_to_enqueue(job, payload, max_bytes=max_bytes, path=f"payloads[{i}]")
            for i, payload in enumerate(payloads)
        ]
        delay_ms = check_delay_ms(name, delay_ms)
        priority = check_priority(name, priority)
        fair_key = check_fair_key(name, fair_key)
        keyed: list[str] | None = None
        if dedup_keys is not None:
            keyed = [
                check_dedup_key(name, f"dedup_keys[{i}]", key) for i, key in enumerate(dedup_keys)
            ]
            if len(keyed) != len(bodies):
                raise PayloadError(
                    name, "dedup_keys", f"must give one key per payload ({len(bodies)})", keyed
                )
        idempotent: list[str] | None = None
        if idempotency_keys is not None:
            idempotent = [
                check_dedup_key(name, f"idempotency_keys[{i}]", key)
                for i, key in enumerate(idempotency_keys)
            ]
            if len(idempotent) != len(bodies):
                raise PayloadError(
                    name,
                    "idempotency_keys",
                    f"must give one key per payload ({len(bodies)})",
                    idempotent,
                )
            if keyed is not None:
                raise PayloadError(name, "idempotency_keys", "cannot go with dedup_keys")
        return Many(job, bodies, delay_ms, priority, fair_key, keyed, idempotent)

    def _enqueue_many(self, many: Many) -> list[str]:
        """Enqueue what :meth:`_checked_many` checked, in batches; the message ids, in order."""
        job, bodies, delay_ms = many.job, many.bodies, many.delay_ms
        priority, fair_key = many.priority, many.fair_key
        keyed, idempotent = many.dedup_keys, many.idempotency_keys
        name = job.qualified_name
        ids: list[str] = []
        with self._redis("dispatching " + name):
            for start in range(0, len(bodies), DISPATCH_BATCH):
                batch = bodies[start : start + DISPATCH_BATCH]
                if idempotent is not None:
                    ids += self.broker.enqueue_idempotent_many(
                        [self._manual(job, body, priority, fair_key) for body in batch],
                        [
                            keys.idempotency(self.queue_prefix, name, key)
                            for key in idempotent[start : start + DISPATCH_BATCH]
                        ],
                        self.settings.idempotency_ttl_s * 1000,
                        delay=delay_ms,
                    )
                    continue
                if keyed is not None:
                    ids += dispatch_many_with_keys(
                        self.runtime,
                        job,
                        batch,
                        keyed[start : start + DISPATCH_BATCH],
                        trigger="manual",
                        delay_ms=delay_ms,
                        priority=priority,
                        fair_key=fair_key,
                    )
                    continue
                messages = [self._manual(job, body, priority, fair_key) for body in batch]
                self.broker.enqueue_many(messages, delay=delay_ms)
                ids += [str(message.message_id) for message in messages]
        return ids

    @_fronted
    def handle_event(
        self, event_name: str, payload: dict[str, Any] | BaseModel | None = None
    ) -> list[str]:
        """Dispatch every job whose trigger is ``Event(event_name)``; return their ids.

        The payload (a dict, or a pydantic model instance, taken as its
        ``model_dump(mode="json")``) is checked, validated against the model of every typed
        job the event starts, and the dedup key of every job whose ``Event`` names a key
        function (which receives the dict) is computed, all before any is enqueued; a typed
        job enqueues its model's dump, a keyed job goes through its dedup key. An event no
        job listens to returns ``[]``.
        """
        return [
            self._enqueue_event(event_name, job, body, dedup_key)
            for job, body, dedup_key in self._event_parts(event_name, payload)
        ]

    def _event_parts(
        self, event_name: str, payload: dict[str, Any] | BaseModel | None
    ) -> list[tuple[JobDefinition, dict[str, Any], str | None]]:
        """Every job ``event_name`` starts, with its checked body and dedup key (see
        :meth:`handle_event`); nothing is enqueued."""
        jobs = self.registry.jobs_for_event(event_name)
        if not jobs:
            return []
        max_bytes = self.settings.max_payload_bytes
        body = event_payload(event_name, payload, max_bytes=max_bytes)
        bodies = [
            body
            if job.payload_model is None
            else payload_to_enqueue(job, body, max_bytes=max_bytes)
            for job in jobs
        ]
        return list(zip(jobs, bodies, event_dedup_keys(jobs, body), strict=True))

    def _enqueue_event(
        self, event_name: str, job: JobDefinition, body: dict[str, Any], dedup_key: str | None
    ) -> str:
        """Enqueue the run of ``job`` that ``event_name`` starts (checked parts); its id."""
        with self._redis(f"handling event {event_name}"):
            if dedup_key is not None:
                return dispatch_with_key(
                    self.runtime, job, body, dedup_key, trigger="event", delay_ms=None
                )
            message = build_message(
                job,
                body,
                queue_prefix=self.queue_prefix,
                trigger="event",
                message_id=self._new_id(),
            )
            self.broker.enqueue(message)
        return str(message.message_id)

    # -- run history ------------------------------------------------------
    @property
    def history(self) -> RunHistory:
        """Queries over this dataset's run history (no connection until used; every
        shard's, on several)."""
        if self._fleet is not None:
            return ShardedHistory([shard.history for shard in self._fleet.shards])
        return RunHistory(self.broker.client, self.broker.lua, self.queue_prefix)

    @_fronted
    def runs(
        self,
        job: str | None = None,
        *,
        status: RunStatus | None = None,
        tenant_id: str | None = None,
        message_id: str | None = None,
        origin_id: str | None = None,
        since: datetime | None = None,
        before: datetime | JobRun | None = None,
        limit: int = 50,
    ) -> list[JobRun]:
        """Run records, newest first: by the attempt's start (its enqueue time if it never
        started), ties by ``run_id``; filtered by job, status, tenant, message id, origin id
        and start (``since`` <= start); ``before`` a time (started before it) or the last
        :class:`JobRun` of the previous page (the next page starts right after it, so walking
        pages yields every record exactly once); ``limit`` at most 1,000. Raises
        ``UnknownJobError`` for a job the registry does not declare."""
        if job is not None:
            self._job(job)
        if status is not None and status not in STATUSES:
            raise JobConfigError(None, "status", f"must be one of {', '.join(STATUSES)}", status)
        if not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit <= 1_000:
            raise JobConfigError(None, "limit", "must be an integer from 1 to 1000", limit)
        for name, when in (("since", since), ("before", before)):
            if isinstance(when, JobRun) and name == "before":
                continue
            if when is not None and (not isinstance(when, datetime) or when.tzinfo is None):
                raise JobConfigError(None, name, "must be an aware datetime", when)
        with self._redis("reading the run history"):
            return self.history.runs(
                job,
                status=status,
                tenant_id=tenant_id,
                message_id=message_id,
                origin_id=origin_id,
                since=since,
                before=before,
                limit=limit,
            )

    @_fronted
    def stats(self, job: str | None = None, *, hours: int = 24) -> list[JobStats]:
        """Per job and hour (UTC), newest hour first, hours with no attempt left out: attempts
        completed, failed (and retried), dead and cancelled, and the p50 and p95 duration of
        the completed ones (within 5%); ``hours`` from 1 to 168 (kept 7 days). Every declared
        job, or ``job`` alone (``UnknownJobError`` if undeclared). One round trip, no
        run-history scan (:mod:`kumiko_dramatiq.ops.stats`)."""
        if job is not None:
            self._job(job)
        if not isinstance(hours, int) or isinstance(hours, bool) or not 0 < hours <= MAX_HOURS:
            raise JobConfigError(None, "hours", f"must be an integer from 1 to {MAX_HOURS}", hours)
        jobs = [job] if job is not None else list(self.registry.jobs)
        with self._redis("reading the job stats"):
            return read_stats(self.broker.client, self.queue_prefix, jobs, hours, datetime.now(UTC))

    @_fronted
    def run_record(self, message_id: str) -> list[JobRun]:
        """Every recorded attempt of ``message_id``, oldest first."""
        _check_message_id(message_id)
        with self._redis("reading the run history"):
            return self.history.run_record(message_id)

    @_fronted
    def drain(self, timeout_s: float = 30) -> list[JobRun]:
        """Wait until nothing of this dataset is queued, delayed, backing off or running (both
        lanes, any worker), then return the runs that ended since the previous ``drain`` (the
        first: since this runner was built), oldest first. Raises ``DrainTimeoutError``
        naming what is still pending after ``timeout_s`` (:mod:`kumiko_dramatiq.ops.draining`)."""
        with self._redis("draining"):
            return self._drain(timeout_s)

    # -- schedules (see kumiko_dramatiq.schedules) ------------------------------
    @functools.cached_property
    def schedules(self) -> Schedules:
        """The dataset's schedules: runtime ones (``upsert``, ``get``, ``list``, ``pause``,
        ``resume``, ``remove``, ``trigger``) and the code-declared cron jobs beside them (on
        several shards: each in the shard of its job, :mod:`kumiko_dramatiq.shards.schedules`)."""
        if self._fleet is not None:
            return ShardedSchedules([shard.schedules for shard in self._fleet.shards])
        return Schedules(
            self.broker,
            self.registry,
            max_payload_bytes=self.settings.max_payload_bytes,
            guard_ttl_ms=self.retention.completed_age_s * 1000,
        )

    # -- results (see kumiko_dramatiq.workflows.results) ----------------------
    @functools.cached_property
    def results(self) -> Results:
        """The reads of kept results over this runner's dataset (``result`` uses it)."""
        return Results(self.broker.client, self.queue_prefix, self.registry, lambda: self.admin)

    @_fronted
    def result(self, message_id: str, *, timeout_s: float = 0) -> Any:
        """What the completed run of ``message_id`` returned, kept by its job's
        ``keep_result_s`` (a model instance when the handler's return annotation is one).

        Waits up to ``timeout_s`` (0: looks once) without polling: the settle that ends the
        message wakes the wait. Raises :class:`ResultPending` if it has not ended by then,
        :class:`JobFailedError` (``.status`` ``"dead"`` or ``"cancelled"``) if it ended
        without a value, :class:`NotFoundError` for an id that is unknown, whose records
        expired, whose result is past its TTL or whose job keeps none (the message says
        which), :class:`ResultError` for a kept value that no longer validates against the
        return model, :class:`RedisUnavailableError` when Redis does not answer."""
        _check_result_wait(message_id, timeout_s)
        with self._redis("reading a result"):
            return self.results.result(message_id, timeout_s=timeout_s)

    # -- batches and chains (see kumiko_dramatiq.workflows.batches) ----------
    @_fronted
    def dispatch_batch(
        self,
        items: Sequence[Item],
        *,
        on_success: Item | None = None,
        on_complete: Item | None = None,
        idempotency_key: str | None = None,
        priority: int | None = None,
    ) -> str:
        """Enqueue one child per ``(job_name, payload)`` item as one batch; return its id.
        ``priority``: every child's (``None``: each its job's own).

        Every item is validated first (``PayloadError`` naming its index; an unknown job
        names it too): nothing is enqueued then. No child starts unless every child was
        written, also when Redis fails mid-call (all or none: ``RedisUnavailableError``, and
        nothing of the batch ever runs). When every child ended (completed, dead, cancelled,
        purged), ``on_complete`` is enqueued once; ``on_success`` once if every child
        completed. Each callback's ``ctx.batch.results()`` tells how each child ended, in
        dispatch order, with its value. With ``idempotency_key``, a batch dispatched with a
        key used within ``idempotency_ttl_s`` returns the first batch's id and writes nothing
        (as ``dispatch``'s key)."""
        with self._redis("dispatching a batch"):
            return self.runtime.batches.dispatch_batch(
                items,
                on_success=on_success,
                on_complete=on_complete,
                idempotency_key=idempotency_key,
                priority=priority,
            )

    @_fronted
    def dispatch_chain(
        self,
        steps: Sequence[Item | Sequence[Item]],
        *,
        idempotency_key: str | None = None,
        priority: int | None = None,
    ) -> str:
        """Enqueue a chain: each step (an item, or a list of items: a group) once the step
        before completed, its handlers seeing ``ctx.previous_result``; a step that does not
        complete stops the chain (``failed``). All steps are validated and written first,
        all or none. ``result(chain_id)`` is the last step's value. ``idempotency_key``: as
        ``dispatch_batch``'s; ``priority``: every step's children's."""
        with self._redis("dispatching a chain"):
            return self.runtime.batches.dispatch_chain(
                steps, idempotency_key=idempotency_key, priority=priority
            )

    @_fronted
    def batch(self, batch_id: str) -> BatchStatus:
        """The state and counts of a batch or chain; ``NotFoundError`` for an unknown id."""
        _check_message_id(batch_id)
        with self._redis("reading a batch"):
            return self.runtime.batches.status(batch_id)

    @_fronted
    def batches(self, *, state: str | None = None, limit: int = 100) -> list[BatchStatus]:
        """Batches and chains, newest first, at most ``limit``, those in ``state`` if given
        (``running``, ``succeeded``, ``failed``, ``cancelled``)."""
        if state is not None and state not in BATCH_STATES:
            raise ValueError(f"state must be one of {', '.join(BATCH_STATES)}, got {state!r}")
        _check_limit(limit, 1_000)
        with self._redis("reading the batches"):
            return self.runtime.batches.listed(state=state, limit=limit)

    @_fronted
    def cancel_batch(self, batch_id: str) -> int:
        """Cancel a batch or chain: children not started never start (returns how many),
        running ones end as they do; it ends ``cancelled``: ``on_complete`` still runs,
        ``on_success`` does not, a chain opens no further step. ``NotFoundError`` for an
        unknown id."""
        _check_message_id(batch_id)

        def cancel_one(message_id: str) -> bool:
            try:
                return self.cancel(message_id)
            except NotFoundError:
                return False

        with self._redis("cancelling a batch"):
            cancelled = self.runtime.batches.cancel(batch_id, cancel_one)
            self.results.announce(batch_id)
            return cancelled

    # -- operating (see kumiko_dramatiq.ops.admin) ----------------------------
    @property
    def admin(self) -> Admin:
        """The admin API over this runner's dataset (no connection until used; over every
        shard, on several: :mod:`kumiko_dramatiq.shards.admin`)."""
        if self._fleet is not None:
            return ShardedAdmin([shard.admin for shard in self._fleet.shards])
        return Admin(self.broker, self.registry, self.settings)

    # Reads straight off the admin API: each checks a ``job`` argument it is given (an
    # unknown one raises ``UnknownJobError``) and maps a Redis failure to
    # ``RedisUnavailableError``; the rest is :class:`Admin`'s.
    status = _reads_admin(
        Admin.status,
        "reading the status",
        """Per lane: queued, delayed, running, dead (and parked) counts; live workers and
        schedulers; paused jobs.""",
    )
    jobs = _reads_admin(
        Admin.jobs,
        "reading the jobs",
        "Every declared job with its options, lane, next and last cron fire, paused.",
    )
    dead_letters = _reads_admin(
        Admin.dead_letters,
        "reading the dead letters",
        "Dead-lettered messages, newest first, with their last error and traceback.",
    )
    job_counts = _reads_admin(
        Admin.job_counts,
        "reading the job counts",
        """Every declared job -> ``{"queued", "delayed", "running", "parked", "dead"}``:
        exact, kept by the scripts that move messages (filled in for older data at first
        use, in bounded steps); messages waiting for a slot count as queued.""",
    )
    running = _reads_admin(
        Admin.running,
        "reading the running attempts",
        """The attempts running now (status ``running``, with ``worker`` and ``started_at``,
        and the ``progress`` an attempt reported), longest running first.""",
    )
    locks = _reads_admin(
        Admin.locks,
        "reading the locks",
        """Held sequential locks (at most ``limit``), by job and tenant, with the run holding
        each, when it was taken and whether its holder's worker is alive.""",
    )
    dedup_keys = _reads_admin(
        Admin.dedup_keys,
        "reading the dedup keys",
        "Live dedup keys (at most ``limit``), by job, newest first.",
    )

    @_fronted
    def retry_dead(self, message_id: str) -> str | Literal[False]:
        """Re-enqueue dead letter ``message_id`` with a fresh attempt budget (one atomic step
        with its removal from the dead letters); return the id that will run. ``False`` when
        the message is known but not a dead letter (it waits, runs, or ended otherwise);
        raises :class:`NotFoundError` when there is no trace of it."""
        _check_message_id(message_id)
        with self._redis("retrying a dead letter"):
            new_id = self.admin.retry_dead(message_id)
            if new_id is None and self.admin.known(message_id):
                return False
        if new_id is None:
            raise NotFoundError(f"message {message_id} is not a dead letter")
        return new_id

    @_fronted
    def delete_dead(self, message_id: str) -> bool:
        """Discard dead letter ``message_id``: ``True``; ``False`` when the message is known
        but not a dead letter; raises :class:`NotFoundError` when there is no trace of it."""
        _check_message_id(message_id)
        with self._redis("deleting a dead letter"):
            if self.admin.delete_dead(message_id):
                return True
            if self.admin.known(message_id):
                return False
        raise NotFoundError(f"message {message_id} is not a dead letter")

    @_fronted
    def purge(self, job: str, *, state: str = "queued", dry_run: bool = False) -> int:
        """Remove ``job``'s messages in ``state`` (``"queued"``, ``"delayed"``, ``"parked"``
        or ``"dead"``) in bounded steps; return how many (with ``dry_run``: how many there
        are, nothing removed). Dedup keys they hold are freed; one WARNING line with the
        count; no run record per message. A running message is never removed."""
        definition = self._job(job)
        if state not in PURGE_WALKS:
            raise ValueError(f"{job}: state must be one of {', '.join(PURGE_WALKS)}, got {state!r}")
        with self._redis("purging messages"):
            purged = self.admin.purge(definition, state, dry_run=dry_run)
            if purged and not dry_run:
                self.results.announce(EVERY_RESULT)  # result waiters look again
            return purged

    @_fronted
    def cancel(self, message_id: str) -> bool:
        """Make sure ``message_id`` never starts if it has not: ``True`` if it was queued,
        delayed, waiting out a backoff or a lock, or parked; ``False`` (nothing changed) if it
        is running or has ended (completed, dead or cancelled already). Raises
        :class:`NotFoundError` when no message of that id waits, runs or left a run record.
        Costs a few key reads, whatever the size of the queues (see
        :meth:`~kumiko_dramatiq.ops.admin.Admin.cancel`)."""
        _check_message_id(message_id)
        with self._redis("cancelling a message"):
            cancelled, why = self.admin.cancel(message_id)
            if cancelled:
                self.results.announce(message_id)
        if not cancelled and why == "gone":
            raise NotFoundError(
                f"message {message_id} is not queued, delayed or running, and has no run record"
            )
        return cancelled

    @_fronted
    def queued(
        self,
        job: str | None = None,
        *,
        state: str | None = None,
        limit: int = 50,
        after: QueuedMessage | None = None,
    ) -> list[QueuedMessage]:
        """Waiting messages (``job``'s, in ``state``: ``"queued"``, ``"parked"`` or
        ``"delayed"``; all of them when ``None``), at most ``limit``: queued and parked
        oldest first, delayed soonest due first (off their schedule); ``after`` = the
        last of the previous page. Each carries its payload. Costs the page, never a walk
        of a queue."""
        if job is not None:
            self._job(job)
        if state is not None and state not in WAITING_STATES:
            raise ValueError(f"state must be one of {', '.join(WAITING_STATES)}, got {state!r}")
        _check_limit(limit, 1_000)
        with self._redis("reading the waiting messages"):
            return self.admin.queued(job, state=state, limit=limit, after=after)

    @_fronted
    def job_state(self, message_id: str) -> str:
        """Where ``message_id`` is in its life: ``"queued"``, ``"delayed"`` (also backing off
        before a retry), ``"parked"`` (its job is paused), ``"running"``, ``"completed"``,
        ``"dead"``, ``"cancelled"``, or ``"unknown"`` (never seen, or its records expired).
        A few key reads, whatever the size of the queues (``kumiko state ID``)."""
        _check_message_id(message_id)
        with self._redis("reading a message's state"):
            return self.admin.job_state(message_id)

    @_fronted
    def run_now(self, message_id: str) -> bool:
        """Queue a delayed or backing-off message now, same id and attempt: ``True``;
        ``False`` when it is not delayed; raises :class:`NotFoundError` when no message of
        that id waits, runs or left a run record."""
        _check_message_id(message_id)
        with self._redis("queueing a delayed message now"):
            moved = self.admin.run_now(message_id)
        if moved is None:
            raise NotFoundError(
                f"message {message_id} is not queued, delayed or running, and has no run record"
            )
        return moved

    @_fronted
    def stop_run(self, message_id: str) -> bool:
        """Ask the running attempt of ``message_id`` to stop: within about a second
        ``ctx.stop_requested`` is true and the handler is interrupted (a sync one as by a
        timeout, an ``async def`` one's task cancelled); the attempt ends ``cancelled``, is
        not retried and releases its lock and dedup key. ``False`` when it is not running;
        raises :class:`NotFoundError` when no message of that id waits, runs or left a run
        record. ``runner.stop()`` stays the graceful shutdown."""
        _check_message_id(message_id)
        with self._redis("stopping a run"):
            asked = self.admin.stop_run(message_id)
        if asked is None:
            raise NotFoundError(
                f"message {message_id} is not queued, delayed or running, and has no run record"
            )
        return asked

    @_fronted
    def pause(self, job: str) -> None:
        """Hold ``job``'s messages back (kept, never run) on every worker until :meth:`resume`."""
        definition = self._job(job)
        with self._redis("pausing a job"):
            self.admin.pause(definition)

    @_fronted
    def resume(self, job: str) -> None:
        """Let a paused job run again; its held-back messages go first."""
        definition = self._job(job)
        with self._redis("resuming a job"):
            self.admin.resume(definition)

    # -- consuming --------------------------------------------------------
    @_fronted
    def start(self) -> None:
        """Boot gates, boot-once enqueue, then consume this runner's lane (on a dataset of
        several shards: of every shard)."""
        self._start(self.worker_threads)

    def _start(self, worker_threads: int) -> None:
        if self._started:
            raise RuntimeError("this JobRunner was started already; build a new one")
        self._check_can_consume()
        self.check_redis()
        self._started = True
        boot = self._middleware(Boot)
        boot.driven_by_runner = True
        self.broker.boot_process()
        try:
            boot.run(self.broker)
        except BaseException:
            self._close()
            raise
        self._worker = Worker(
            self.broker,
            queues={self.runtime.queue_name},
            worker_threads=worker_threads,
            worker_timeout=self.settings.idle_wait_ms,
        )
        self._worker.start()
        if self.run_scheduler:
            self._scheduler = Scheduler(
                self.broker,
                self.registry,
                retention=self.retention,
                max_payload_bytes=self.settings.max_payload_bytes,
                shard=(self.settings.shard, self.settings.shards),
            )
            self._scheduler.start()
        logger.info(
            "kumiko runner consuming %s (%d threads)", self.runtime.queue_name, worker_threads
        )

    def stop(self, timeout_s: float = 30) -> None:
        """Stop consuming, wait up to ``timeout_s`` for running handlers, close (every
        shard's).

        Idempotent; safe on a runner that never started.
        """
        if self._stopped:
            return
        self._stopped = True
        if self._fleet is not None:
            self._fleet.stop(timeout_s)
            self._close_own()
            return
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

    @_fronted
    def check_redis(self) -> None:
        """Wait for Redis (:meth:`wait_for_redis`), then check that it lets this runner do
        everything kumiko needs (``RedisAccessError``, one line naming what is refused:
        :func:`kumiko_dramatiq.broker.acl.check_server`)."""
        self.wait_for_redis()
        with self._redis("checking its permissions"):
            check_server(self.broker, self.redis_url)

    def wait_for_redis(self) -> None:
        """Ping Redis until it answers; ``RedisUnavailableError`` after
        ``boot_redis_timeout_ms``, ``RedisAccessError`` at once when it refuses the
        credentials or the database number, or TLS fails for good (a certificate that does
        not verify: :func:`~kumiko_dramatiq.broker.tls.tls_problem`; a ``redis://`` URL on a
        TLS port or the other way round: :func:`~kumiko_dramatiq.broker.tls.scheme_problem`)."""
        deadline = time.monotonic() + self.boot_redis_timeout_ms / 1000
        last_error: BaseException | None = None
        diagnosed = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RedisUnavailableError(self.redis_url, "starting the runner", last_error)
            probe = redis_client(
                self.redis_url, timeout_s=remaining, queue_prefix=self.queue_prefix
            )
            try:
                probe.ping()
                return
            except redis.AuthenticationError as exc:
                raise RedisAccessError(self.redis_url, f"refuses the credentials: {exc}") from None
            except redis.ResponseError as exc:
                problem = cluster_problem(exc) or f"refuses the connection: {exc}"
                raise RedisAccessError(self.redis_url, problem) from None
            except redis.exceptions.InvalidResponse as exc:
                raise NotRedisError(self.redis_url, "starting the runner", exc) from None
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                if (tls := tls_problem(exc)) is not None:
                    raise RedisAccessError(self.redis_url, tls) from None
                if not diagnosed:  # a plain URL on a TLS port, or the other way round?
                    diagnosed = True
                    if (wrong := scheme_problem(self.redis_url, exc)) is not None:
                        raise RedisAccessError(self.redis_url, wrong) from None
                last_error = exc
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            finally:
                probe.close()

    def job(self, job_name: str) -> JobDefinition:
        """The declared job ``job_name``; ``UnknownJobError`` if the registry lacks it."""
        return self._job(job_name)

    # -- asyncio (see kumiko_dramatiq.aio): each call is its sync twin, carried -----
    @functools.cached_property
    def aio(self) -> LoopClients:
        """This runner's asyncio clients, one per event loop that calls it."""
        pool = self.broker.client.connection_pool
        return LoopClients(
            self.redis_url,
            self.settings.boot_redis_timeout_ms / 1000,
            pool.watch if isinstance(pool, SentinelPool) else None,
        )

    adispatch = asynchronous(dispatch)
    adispatch_many = asynchronous(dispatch_many)
    ahandle_event = asynchronous(handle_event)
    adispatch_batch = asynchronous(dispatch_batch)
    adispatch_chain = asynchronous(dispatch_chain)
    abatch = asynchronous(batch)
    ajob_state = asynchronous(job_state)

    async def aresult(self, message_id: str, *, timeout_s: float = 0) -> Any:
        """The asyncio twin of :meth:`result`: waits on the loop, holding no thread."""
        _check_result_wait(message_id, timeout_s)
        return await aresult(self, message_id, timeout_s)

    async def aclose(self) -> None:
        """Close the running loop's async connections of this runner (``stop()`` closes
        every loop's, and the sync ones)."""
        if "aio" in self.__dict__:
            await self.aio.aclose()

    # -- internals --------------------------------------------------------
    def _new_id(self) -> str:
        """A new message id, one that names this runner's shard
        (:func:`~kumiko_dramatiq.shards.routing.new_id_in`)."""
        return new_id_in(self.settings.shard, self.settings.shards)

    def _job(self, job_name: str) -> JobDefinition:
        try:
            return self.registry.jobs[job_name]
        except (KeyError, TypeError):
            raise UnknownJobError(str(job_name), list(self.registry.jobs)) from None

    @contextmanager
    def _redis(self, action: str) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as exc:
            raise kumiko_error(self.redis_url, action, exc) from exc

    def _close_own(self) -> None:
        """Close what this runner object opened itself (its result listener, its asyncio
        clients); the broker is its shard's."""
        if "results" in self.__dict__:
            self.results.close()
        if "aio" in self.__dict__:
            self.aio.close()

    def _middleware(self, kind: type[Any]) -> Any:
        for middleware in self.broker.middleware:
            if isinstance(middleware, kind):
                return middleware
        raise LookupError(kind.__name__)

    def _check_can_consume(self) -> None:
        check_no_dramatiq_retries(self.broker.middleware)
        check_lane_can_run(self.runtime)

    def _close(self) -> None:
        self._close_own()
        self.runtime.loop.stop()
        self.broker.close()


def _check_result_wait(message_id: object, timeout_s: object) -> None:
    _check_message_id(message_id)
    if (
        not isinstance(timeout_s, int | float)
        or isinstance(timeout_s, bool)
        or not 0 <= timeout_s <= MAX_RESULT_WAIT_S
    ):
        raise ValueError(
            f"timeout_s must be a number from 0 to {MAX_RESULT_WAIT_S}, got {timeout_s!r}"
        )


#: The most entries a listing of the admin reads (``dead_letters``, ``locks``,
#: ``dedup_keys``) returns at once.
MAX_LISTED = 10_000


def _check_limit(limit: object, most: int) -> None:
    if not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit <= most:
        raise ValueError(f"limit must be an int from 1 to {most}, got {limit!r}")


def _check_message_id(message_id: object) -> None:
    if not isinstance(message_id, str) or not _MESSAGE_ID.fullmatch(message_id):
        raise JobConfigError(
            None, "message_id", "must be a message id (letters, digits, . _ : -)", message_id
        )


_MESSAGE_ID = re.compile(r"[A-Za-z0-9._:-]{1,200}")


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
        window_ms = retry_window_ms(job.options)
        if window_ms >= limit_ms:
            raise JobConfigError(
                job.qualified_name,
                "retries/backoff",
                f"give a retry window of {window_ms} ms, not below "
                f"retention.completed_age_s ({retention.completed_age_s} s): child dedup "
                "records would expire while the wrapper can still retry",
            )
