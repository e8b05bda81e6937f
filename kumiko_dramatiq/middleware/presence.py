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
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from typing import Any, Final, Literal

import redis
from dramatiq.broker import Broker
from dramatiq.middleware import Middleware
from dramatiq.worker import Worker

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.replies import text

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
        }


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
    ) -> None:
        self.client = client
        self.queue_prefix = queue_prefix
        self.identity = identity
        self.ttl_ms = ttl_ms
        self._info = {
            "id": identity,
            "role": role,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "lane": lane,
            "version": _version(),
            "started_at": int(time.time() * 1000),
        }
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Register now (errors propagate: the caller checked Redis), then keep refreshing."""
        self._refresh()
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
        while not self._stopping.wait(interval_s):
            try:
                self._refresh()
            except redis.RedisError as exc:
                logger.warning("could not refresh the liveness of %s (%s)", self.identity, exc)

    def _refresh(self) -> None:
        now_ms = int(time.time() * 1000)
        pipe = self.client.pipeline(transaction=False)
        pipe.set(
            keys.process(self.queue_prefix, self.identity),
            json.dumps({**self._info, "last_seen": now_ms}),
            px=self.ttl_ms,
        )
        pipe.zadd(keys.processes(self.queue_prefix), {self.identity: now_ms})
        pipe.pexpire(keys.processes(self.queue_prefix), PROCESSES_TTL_MS)
        pipe.execute()


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
    for value in raw:
        if value is None:
            continue
        data = json.loads(value)
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
            )
        )
    return sorted(found, key=lambda info: (info.role, info.started_at))


class Presence(Middleware):
    """Registers a worker process while its Dramatiq worker runs (``after_worker_boot`` to
    ``before_worker_shutdown``). Touches ``keys.process`` and ``keys.processes``."""

    def __init__(self, client: redis.Redis, queue_prefix: str, lane: str, ttl_ms: int) -> None:
        self.client = client
        self.queue_prefix = queue_prefix
        self.lane = lane
        self.ttl_ms = ttl_ms
        self._registration: Registration | None = None

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        registration = Registration(
            self.client,
            self.queue_prefix,
            identity=str(getattr(broker, "broker_id", id(broker))),
            role="worker",
            lane=self.lane,
            ttl_ms=self.ttl_ms,
        )
        try:
            registration.start()
        except redis.RedisError as exc:
            logger.warning("could not register this worker as alive (%s)", exc)
            return
        self._registration = registration

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        registration, self._registration = self._registration, None
        if registration is not None:
            registration.stop()
