"""Shared fixtures: a real Redis, a private queue prefix per test, runners that clean up.

Redis comes from ``KUMIKO_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/15``).
If it does not answer, the whole run fails at once; tests never skip for a
missing Redis. Each test gets its own queue prefix; every key of that prefix
(kumiko's and Dramatiq's) is deleted before and after the test.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from kumiko_dramatiq import JobMeta, JobRunner, Registry

REDIS_URL = os.environ.get("KUMIKO_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The unit tests run first, in a process no integration test has touched yet: they are
    quick and fail fast, and the CPU-bound property tests (``test_cron_dst``, hypothesis) ran
    more than 120 s, once in two CI runs, after the integration tests' hundreds of runners
    (cause not found; alone they take seconds). Otherwise the order is pytest's."""
    unit = [item for item in items if "/tests/unit/" in str(item.path)]
    if unit:
        rest = [item for item in items if "/tests/unit/" not in str(item.path)]
        items[:] = unit + rest


def pytest_sessionstart(session: pytest.Session) -> None:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.exit(
            f"Redis at {REDIS_URL} does not answer ({exc}); the tests need a real Redis. "
            "Run `bash tests/run.sh`, which starts one, or set KUMIKO_TEST_REDIS_URL.",
            returncode=3,
        )


@pytest.fixture(scope="session")
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def delete_prefix(client: redis.Redis, prefix: str) -> None:
    """Delete every key of queue prefix ``prefix``, kumiko's and Dramatiq's, and of the
    other shards of its dataset (``{prefix}.shard{i}``, ``shards=N``)."""
    for pattern in (
        f"kumiko:{prefix}:*",
        f"dramatiq:{prefix}-*",
        f"dramatiq:__acks__.*.{prefix}-*",
        f"kumiko:{prefix}.shard*",
        f"dramatiq:{prefix}.shard*",
        f"dramatiq:__acks__.*.{prefix}.shard*",
    ):
        batch = list(client.scan_iter(match=pattern, count=1000))
        if batch:
            client.delete(*batch)


@pytest.fixture
def prefix(request: pytest.FixtureRequest, redis_client: redis.Redis) -> Iterator[str]:
    name = "".join(c if c.isalnum() else "_" for c in request.node.name)[:40]
    value = f"t_{name}_{uuid.uuid4().hex[:8]}"
    delete_prefix(redis_client, value)
    yield value
    delete_prefix(redis_client, value)


RunnerFactory = Callable[..., JobRunner]


@pytest.fixture
def make_runner(redis_url: str, prefix: str) -> Iterator[RunnerFactory]:
    """``make_runner(registry, **options)``: a runner on this test's prefix, stopped after it."""
    runners: list[JobRunner] = []

    def make(registry: Registry, **options: Any) -> JobRunner:
        options.setdefault("redis_url", redis_url)
        options.setdefault("queue_prefix", prefix)
        options.setdefault("worker_threads", 4)
        options.setdefault("boot_redis_timeout_ms", 2_000)
        runner = JobRunner(registry, **options)
        runners.append(runner)
        return runner

    yield make
    for runner in reversed(runners):
        runner.stop(timeout_s=10)


@dataclass
class HookEvent:
    kind: str  # "start" | "complete" | "failed"
    job_name: str
    message_id: str
    meta: JobMeta
    exc: BaseException | None = None


@dataclass
class Recorder:
    """Collects hook calls; ``wait_until`` blocks on a condition, never on a sleep."""

    events: list[HookEvent] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def on_job_start(self, job_name: str, message_id: str, meta: JobMeta) -> None:
        self._add(HookEvent("start", job_name, message_id, meta))

    def on_job_complete(self, job_name: str, message_id: str, meta: JobMeta) -> None:
        self._add(HookEvent("complete", job_name, message_id, meta))

    def on_job_failed(
        self, job_name: str, message_id: str, meta: JobMeta, exc: BaseException
    ) -> None:
        self._add(HookEvent("failed", job_name, message_id, meta, exc))

    def hooks(self) -> dict[str, Any]:
        return {
            "on_job_start": self.on_job_start,
            "on_job_complete": self.on_job_complete,
            "on_job_failed": self.on_job_failed,
        }

    def _add(self, event: HookEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def of(self, kind: str, job_name: str | None = None) -> list[HookEvent]:
        with self._cond:
            return [
                e
                for e in self.events
                if e.kind == kind and (job_name is None or e.job_name == job_name)
            ]

    def wait_until(
        self, predicate: Callable[[Recorder], bool], timeout_s: float = 20, what: str = ""
    ) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(
                        f"timed out after {timeout_s}s waiting for {what or predicate}; "
                        f"events: {[(e.kind, e.job_name, e.meta.attempt) for e in self.events]}"
                    )
                self._cond.wait(remaining)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


def wait_for(predicate: Callable[[], bool], timeout_s: float = 20, what: str = "") -> None:
    """Poll ``predicate`` (state in Redis or a subprocess) until true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        time.sleep(0.02)


@pytest.fixture
def not_redis_server() -> Iterator[int]:
    """A TCP port where an HTTP server answers whatever it is sent with a 400 and hangs up
    (another service on the port Redis was meant to have)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stopping = threading.Event()

    def serve() -> None:
        while not stopping.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(4096)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stopping.set()
    server.close()
    thread.join(timeout=5)
