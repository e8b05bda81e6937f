"""What the example apps share: where they run, what they record, and the driver's context.

Every process of a run (the driver, its CLI workers, a scheduler) reads the same variables,
set by the harness (:mod:`tests.compat.apps.__main__`):

- ``COMPAT_APP``: the scenario (a module of this package);
- ``COMPAT_BROKER``: ``plain`` (Dramatiq's ``RedisBroker``, :mod:`.plain`) or ``kumiko``
  (``dramatiq kumiko_dramatiq.app`` with ``KUMIKO_APP`` naming :mod:`.app`);
- ``COMPAT_REDIS_URL``: the harness's private redis-server, flushed before each run.

Actors record what they did with :func:`record`; :class:`Observed`, added to both brokers,
records every processed, skipped and dead-lettered message. The driver reads them back with
:meth:`Context.wait`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from dramatiq.broker import Broker
from dramatiq.middleware import Middleware

ROOT = Path(__file__).resolve().parents[3]
APP = os.environ.get("COMPAT_APP", "")
BROKER = os.environ.get("COMPAT_BROKER", "")
URL = os.environ.get("COMPAT_REDIS_URL", "")
EVENTS = "compat-apps:events"
#: Dramatiq's worker heartbeats (a sorted set), which both brokers write as they fetch.
HEARTBEATS = "dramatiq:__heartbeats__"

_client: redis.Redis | None = None


def client() -> redis.Redis:
    """This process's client of the run's Redis (made on first use: workers fork)."""
    global _client
    if _client is None:
        if not URL:
            raise RuntimeError("COMPAT_REDIS_URL is not set: run python -m tests.compat.apps")
        _client = redis.Redis.from_url(URL)
    return _client


def record(event: str, **fields: Any) -> None:
    """Note that ``event`` happened, with ``fields`` (JSON, else their ``repr``), in the run's
    event list."""
    client().rpush(EVENTS, json.dumps({"event": event, **fields}, sort_keys=True, default=repr))


def events() -> list[dict[str, Any]]:
    """Every event recorded so far, in the order recorded."""
    return [json.loads(raw) for raw in client().lrange(EVENTS, 0, -1)]


class Observed(Middleware):
    """Records every message processed (with its error's type and Dramatiq's ``retries``),
    skipped or dead-lettered: added last to both brokers, after their own chains."""

    def after_process_message(
        self, broker: Broker, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        record(
            "processed",
            actor=message.actor_name,
            args=list(message.args),
            error=None if exception is None else type(exception).__name__,
            retries=message.options.get("retries", 0),
        )

    def after_skip_message(self, broker: Broker, message: Any) -> None:
        record("skipped", actor=message.actor_name, args=list(message.args))

    def after_nack(self, broker: Broker, message: Any) -> None:
        record("dead", actor=message.actor_name, args=list(message.args))


def of(seen: Sequence[dict[str, Any]], event: str, **match: Any) -> list[dict[str, Any]]:
    """The events named ``event`` whose fields include ``match``."""
    return [
        each
        for each in seen
        if each["event"] == event and all(each.get(k) == v for k, v in match.items())
    ]


def worker_command(processes: int, threads: int) -> list[str]:
    """The CLI worker of this run's broker, as a user runs it."""
    module = "tests.compat.apps.plain" if BROKER == "plain" else "kumiko_dramatiq.app"
    return [sys.executable, "-m", "dramatiq", module, "-p", str(processes), "-t", str(threads)]


class Context:
    """What a scenario's ``drive`` gets: workers to start and events to wait for."""

    def __init__(self, broker: str, logs: Path) -> None:
        self.broker = broker
        self.logs = logs
        self._started = 0

    @contextmanager
    def worker(
        self, processes: int = 1, threads: int = 4, env: dict[str, str] | None = None
    ) -> Iterator[subprocess.Popen[bytes]]:
        """A ``dramatiq`` CLI worker for this run, consuming once this returns (each of its
        processes has written Dramatiq's worker heartbeat), stopped (SIGTERM) on the way out."""
        with self.process(worker_command(processes, threads), env) as worker:
            deadline = time.monotonic() + 60
            while client().zcard(HEARTBEATS) < processes:
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{APP} on {self.broker}: the worker did not start")
                time.sleep(0.05)
            yield worker

    @contextmanager
    def process(
        self, command: Sequence[str], env: dict[str, str] | None = None
    ) -> Iterator[subprocess.Popen[bytes]]:
        """``command`` in the run's environment, its output in the run's log directory."""
        self._started += 1
        log = self.logs / f"{APP}-{self.broker}-{self._started}.log"
        with log.open("wb") as output:
            child = subprocess.Popen(
                list(command),
                cwd=ROOT,
                env={**os.environ, **(env or {})},
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        try:
            yield child
        finally:
            stop(child)

    def wait(
        self,
        done: Callable[[list[dict[str, Any]]], bool],
        what: str,
        timeout_s: float = 60,
    ) -> list[dict[str, Any]]:
        """Poll the events until ``done(events)``; return them. Raises after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = events()
            if done(seen):
                return seen
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{APP} on {self.broker}: timed out waiting for {what}: {str(seen)[:600]}"
                )
            time.sleep(0.05)


def stop(child: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """SIGTERM ``child`` and wait for it (SIGKILL after ``timeout_s``)."""
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
    try:
        child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
