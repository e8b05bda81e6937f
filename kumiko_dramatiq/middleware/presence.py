"""Liveness: which workers and schedulers are alive, for ``kumiko status`` and the dashboard.

Every worker process (``JobRunner.start()`` or a ``dramatiq kumiko_dramatiq.app`` process,
through the :class:`Presence` middleware) and every scheduler registers itself: a key
``kumiko:{prefix}:proc:{id}`` holding its host, pid, role, lane, version, start and last-seen
times, with a TTL of ``heartbeat_timeout_ms``, refreshed every third of it by a daemon thread
(one pipelined round trip per refresh), and its id in the sorted set ``kumiko:{prefix}:procs``
(scored by the last refresh; the set itself expires ``PROCESSES_TTL_MS`` after the last refresh
of any process). A process that dies stops refreshing, its key expires, and the next listing
forgets it: there are no stale entries. A process that
stops gracefully removes itself at once.

Health rides on the same refresh (no round trip of its own):

- a worker's record carries its supervisor's health (``consumers_down``, ``issues``:
  :class:`~kumiko_dramatiq.worker.supervision.Supervisor`) and its ``ttl_ms``; a reader
  counts a record whose last refresh is older than :func:`stale_after_ms` as a live process
  that cannot refresh its liveness (:attr:`ProcessInfo.stale`);
- every refresh reads the dataset marker (:func:`~kumiko_dramatiq.broker.keys.dataset_marker`,
  written ``NX`` by the first process): one that vanished or changed under a running
  process means the dataset was reset (Redis restarted without persistence, or flushed).
  The process logs it at ERROR and leaves a note
  (:func:`~kumiko_dramatiq.broker.keys.dataset_reset`, kept :data:`RESET_NOTE_TTL_MS`) that
  ``runner.status()`` reports as a problem;
- a worker starting logs an ERROR when Redis's ``maxmemory-policy`` is not ``noeviction``
  (:func:`eviction_policy`): Redis may then evict any key, a queue or a lock included.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from typing import Any, Final, Literal

import redis
from dramatiq.broker import Broker
from dramatiq.middleware import Middleware
from dramatiq.worker import Worker

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.outage import Outage
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.worker.supervision import Deferred, Supervisor, stuck_after_s

#: How long the note of a dataset reset stays (and ``runner.status()`` reports it).
RESET_NOTE_TTL_MS: Final = 3_600_000

#: How long the set of process ids outlives the last refresh of any process (processes may
#: run with different heartbeat timeouts, so the set has one generous TTL of its own).
PROCESSES_TTL_MS: Final = 86_400_000

logger = logging.getLogger("kumiko_dramatiq")

Role = Literal["worker", "scheduler"]


def _version() -> str:
    try:
        return metadata.version("kumiko_dramatiq")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


@dataclass(frozen=True)
class ProcessInfo:
    """A live worker or scheduler process."""

    id: str
    role: Role
    host: str
    pid: int
    lane: str | None
    version: str
    started_at: datetime
    last_seen: datetime
    #: what the process reports of itself (a worker: consumers down or stuck), one line each
    issues: tuple[str, ...] = ()
    #: its consumer threads that are down (ended and not restarted yet, or stuck)
    consumers_down: int = 0
    #: it has not refreshed its liveness for longer than :func:`stale_after_ms` (it is alive,
    #: its record has not expired, but Redis does not hear from it)
    stale: bool = False
    #: how many shards its runner spreads the dataset over (``shards``)
    shards: int = 1

    @property
    def healthy(self) -> bool:
        """Nothing wrong with it: no issue, no consumer down, its liveness refreshed."""
        return not self.issues and not self.consumers_down and not self.stale

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "role": self.role,
            "host": self.host,
            "pid": self.pid,
            "lane": self.lane,
            "version": self.version,
            "started_at": self.started_at.isoformat(),
            "last_seen": self.last_seen.isoformat(),
            "healthy": self.healthy,
            "consumers_down": self.consumers_down,
            "issues": list(self.issues),
        }


def stale_after_ms(ttl_ms: int) -> int:
    """How long after its last refresh a live record counts as stale: two refreshes missed
    (one every third of the TTL) and a second of slack. Pure."""
    return 2 * ttl_ms // 3 + 1_000


def eviction_policy(client: redis.Redis) -> str:
    """Redis's ``maxmemory-policy`` (``INFO memory``; one round trip)."""
    info = client.info("memory")
    return str(info.get("maxmemory_policy", "noeviction"))


def eviction_problem(policy: str) -> str | None:
    """The problem of a ``maxmemory-policy`` other than ``noeviction``, or ``None``. Pure."""
    if policy == "noeviction":
        return None
    return (
        f"Redis maxmemory-policy is {policy}, not noeviction: Redis may evict queued "
        "messages, locks and dedup keys at maxmemory; set maxmemory-policy noeviction"
    )


class Registration:
    """This process's entry in the liveness registry, refreshed by a daemon thread."""

    def __init__(
        self,
        client: redis.Redis,
        queue_prefix: str,
        *,
        identity: str,
        role: Role,
        lane: str | None,
        ttl_ms: int,
        health: Callable[[], dict[str, Any]] | None = None,
        shards: int = 1,
    ) -> None:
        self.client = client
        self.queue_prefix = queue_prefix
        self.identity = identity
        self.ttl_ms = ttl_ms
        self.health = health
        self._info: dict[str, Any] = {
            "id": identity,
            "role": role,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "lane": lane,
            "version": _version(),
            "started_at": int(time.time() * 1000),
            "ttl_ms": ttl_ms,
            "shards": shards,
        }
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        #: the dataset marker this process saw (``None``: not read yet)
        self._dataset: str | None = None
        self._outage = Outage(f"the liveness refresh of {identity}")

    def start(self) -> None:
        """Register now, then keep refreshing. A first refresh that Redis refuses is logged
        and retried by the refresh thread like any other (the process registers once Redis
        answers)."""
        try:
            self._refresh()
        except redis.RedisError as exc:
            logger.warning("could not register %s as alive yet (%s); retrying", self.identity, exc)
        self._thread = threading.Thread(
            target=self._run, name=f"kumiko-presence-{self.identity[:8]}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop refreshing and remove the entry (a Redis error is logged: it expires)."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(keys.process(self.queue_prefix, self.identity))
            pipe.zrem(keys.processes(self.queue_prefix), self.identity)
            pipe.execute()
        except redis.RedisError as exc:
            logger.warning("could not unregister %s (%s); it expires by itself", self.identity, exc)

    def _run(self) -> None:
        interval_s = max(self.ttl_ms / 3, 100) / 1000
        wait_s = interval_s
        while not self._stopping.wait(wait_s):
            try:
                self._refresh()
            except Exception as exc:  # any error: this thread must outlive it
                if not isinstance(exc, redis.RedisError):
                    logger.exception("refreshing the liveness of %s failed", self.identity)
                # retried soon (a stale record is a problem in status), never faster than
                # the backoff
                wait_s = min(interval_s, max(self._outage.failed(exc), 0.2))
            else:
                self._outage.succeeded()
                wait_s = interval_s

    def _refresh(self) -> None:
        now_ms = int(time.time() * 1000)
        health = {} if self.health is None else self.health()
        marker = keys.dataset_marker(self.queue_prefix)
        candidate = uuid.uuid4().hex
        pipe = self.client.pipeline(transaction=False)
        pipe.get(marker)
        pipe.set(marker, candidate, nx=True)
        pipe.set(
            keys.process(self.queue_prefix, self.identity),
            json.dumps({**self._info, **health, "last_seen": now_ms}),
            px=self.ttl_ms,
        )
        pipe.zadd(keys.processes(self.queue_prefix), {self.identity: now_ms})
        pipe.pexpire(keys.processes(self.queue_prefix), PROCESSES_TTL_MS)
        seen, written, *_ = pipe.execute()
        current = candidate if written else None if seen is None else text(seen)
        if current is None:
            return  # another process wrote it meanwhile: read on the next refresh
        if self._dataset is not None and current != self._dataset:
            self._note_reset(now_ms)
        self._dataset = current

    def _note_reset(self, now_ms: int) -> None:
        logger.error(
            "the dataset %s was reset under this process (%s): Redis restarted without "
            "persistence, or was flushed; delayed messages, retries waiting out a backoff, "
            "locks, dedup keys and run records written before are gone",
            self.queue_prefix,
            self.identity,
        )
        note = {"at": now_ms, "by": f"{self._info['host']}:{self._info['pid']}"}
        self.client.set(
            keys.dataset_reset(self.queue_prefix), json.dumps(note), nx=True, px=RESET_NOTE_TTL_MS
        )


def live_processes(client: redis.Redis, queue_prefix: str) -> list[ProcessInfo]:
    """The live processes of a dataset, by role and start; forgets the dead ones."""
    ids = [text(member) for member in client.zrange(keys.processes(queue_prefix), 0, -1)]
    if not ids:
        return []
    raw = client.mget([keys.process(queue_prefix, identity) for identity in ids])
    dead = [identity for identity, value in zip(ids, raw, strict=True) if value is None]
    if dead:
        client.zrem(keys.processes(queue_prefix), *dead)
    found = []
    now_ms = int(time.time() * 1000)
    for value in raw:
        if value is None:
            continue
        data = json.loads(value)
        ttl_ms = data.get("ttl_ms")
        stale = isinstance(ttl_ms, int) and now_ms - int(data["last_seen"]) > stale_after_ms(ttl_ms)
        issues = data.get("issues")
        found.append(
            ProcessInfo(
                id=data["id"],
                role=data["role"],
                host=data["host"],
                pid=int(data["pid"]),
                lane=data.get("lane"),
                version=data["version"],
                started_at=datetime.fromtimestamp(data["started_at"] / 1000, UTC),
                last_seen=datetime.fromtimestamp(data["last_seen"] / 1000, UTC),
                issues=tuple(str(i) for i in issues) if isinstance(issues, list) else (),
                consumers_down=int(data.get("consumers_down") or 0),
                stale=stale,
                shards=int(data.get("shards") or 1),
            )
        )
    return sorted(found, key=lambda info: (info.role, info.started_at))


def consumers_down(client: redis.Redis, queue_prefix: str) -> int:
    """How many consumer threads of the dataset's live workers are down
    (``kumiko_consumers_down``)."""
    return sum(p.consumers_down for p in live_processes(client, queue_prefix) if p.role == "worker")


class Presence(Middleware):
    """Registers a worker process while its Dramatiq worker runs (``after_worker_boot`` to
    ``before_worker_shutdown``), and supervises it meanwhile: a
    :class:`~kumiko_dramatiq.worker.supervision.Supervisor` restarts its consumer threads
    that end and reports the health that goes into the registration; ``deferred`` (the
    runner's retry list of bookkeeping writes) gets its last attempt once the worker has
    stopped (``after_worker_shutdown``). Logs an ERROR at boot when Redis's
    ``maxmemory-policy`` is not ``noeviction``. Touches ``keys.process``,
    ``keys.processes``, ``keys.dataset_marker`` and ``keys.dataset_reset``."""

    def __init__(
        self,
        client: redis.Redis,
        queue_prefix: str,
        lane: str,
        ttl_ms: int,
        deferred: Deferred | None = None,
        shards: int = 1,
    ) -> None:
        self.client = client
        self.queue_prefix = queue_prefix
        self.lane = lane
        self.ttl_ms = ttl_ms
        self.deferred = deferred
        self.shards = shards
        self._registration: Registration | None = None
        self._supervisor: Supervisor | None = None

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        identity = str(getattr(broker, "broker_id", id(broker)))
        self._check_eviction_policy()
        socket_timeout = self.client.connection_pool.connection_kwargs.get("socket_timeout")
        supervisor = Supervisor(
            worker,
            name=identity[:8],
            stuck_after=stuck_after_s(
                worker.worker_timeout,
                float(socket_timeout) if isinstance(socket_timeout, int | float) else None,
            ),
        )
        supervisor.start()
        self._supervisor = supervisor
        registration = Registration(
            self.client,
            self.queue_prefix,
            identity=identity,
            role="worker",
            lane=self.lane,
            ttl_ms=self.ttl_ms,
            health=supervisor.health,
            shards=self.shards,
        )
        registration.start()
        self._registration = registration

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            supervisor.stop()
        registration, self._registration = self._registration, None
        if registration is not None:
            registration.stop()

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        if self.deferred is not None:
            self.deferred.stop()

    def _check_eviction_policy(self) -> None:
        try:
            problem = eviction_problem(eviction_policy(self.client))
        except redis.RedisError as exc:
            logger.warning("could not read Redis's maxmemory-policy (%s)", exc)
            return
        if problem is not None:
            logger.error("%s", problem)
