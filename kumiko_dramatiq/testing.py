"""Helpers for testing the jobs of an app: run a handler in-process, or a real Redis per test.

:func:`run_job` is the unit-test style: it runs one job's handler in the calling process, with
no Redis and no broker, after checking its input exactly as ``JobRunner.dispatch`` does::

    from kumiko_dramatiq.testing import run_job

    def test_invoice_is_sent() -> None:
        run_job(registry, "billing:job:send_invoice", {"invoice": "INV-7", "email": "a@b.c"})

The end-to-end style runs the real thing (Redis, worker, retries, run history) and waits with
``runner.drain()``; :mod:`kumiko_dramatiq.pytest_plugin` gives each test its own dataset.
The pieces it is built from are here, free of pytest, for other test runners:
:func:`private_redis_server` (a throwaway ``redis-server``), :func:`new_queue_prefix` and
:func:`delete_dataset` (every key of one queue prefix).

Nothing here holds state between calls.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import redis
from dramatiq.message import generate_unique_id
from pydantic import BaseModel

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.keys import consumer_acks, queue_list
from kumiko_dramatiq.context import JobContext, JobMeta, Trigger
from kumiko_dramatiq.environment import resolve_settings
from kumiko_dramatiq.errors import (
    JobConfigError,
    PayloadError,
    RedisUnavailableError,
    UnknownJobError,
)
from kumiko_dramatiq.ids import child_message_id
from kumiko_dramatiq.limits import tenant_id_problem
from kumiko_dramatiq.payloads import load_payload, payload_to_enqueue
from kumiko_dramatiq.progress import InMemoryProgress
from kumiko_dramatiq.registry import JobDefinition, Registry
from kumiko_dramatiq.runner import JobRunner
from kumiko_dramatiq.worker.loop import EventLoopThread

__all__ = [
    "InMemoryProgress",
    "RunnerFactory",
    "delete_dataset",
    "new_queue_prefix",
    "private_redis_server",
    "run_job",
]

#: The type of the ``kumiko_runner`` fixture (:mod:`kumiko_dramatiq.pytest_plugin`):
#: ``kumiko_runner(registry, **options) -> JobRunner``. Import it from here, not from the
#: plugin module, which pytest must import first to rewrite its asserts.
RunnerFactory = Callable[..., JobRunner]

#: How long :func:`private_redis_server` waits for its server to answer.
SERVER_START_TIMEOUT_S: Final = 10.0


#: What the pytest plugin's ``kumiko_runner`` gives a runner unless the test says otherwise:
#: few threads, a quick sequential hand-off, ``timeout_ms`` checked often, a short wait for
#: Redis, and a short idle wait (it bounds how long ``stop()`` takes: 200 ms by default, 20 ms
#: here).
RUNNER_DEFAULTS: Final[dict[str, Any]] = {
    "worker_threads": 4,
    "sequential_retry_delay_ms": 50,
    "timeout_check_ms": 100,
    "boot_redis_timeout_ms": 2_000,
    "idle_wait_ms": 20,
}


def run_job(
    registry: Registry,
    job_name: str,
    payload: dict[str, Any] | BaseModel | None = None,
    *,
    tenant_id: str | None = None,
    attempt: int = 1,
    app: Any = None,
    progress: InMemoryProgress | None = None,
) -> Any:
    """Run the handler of ``job_name`` once, in this process, and return what it returns.

    No Redis, no broker, no worker: the handler gets a real :class:`JobContext` whose
    :class:`JobMeta` is that of attempt ``attempt`` (1-based, at most the job's
    ``retries + 1``; ``final_attempt`` follows) of a message ``dispatch`` would have enqueued:
    trigger ``"manual"``, a fresh message id, ``ctx.app`` = ``app``. The payload is checked
    exactly as ``dispatch`` checks it (the same function, with the ``max_payload_bytes`` a
    ``JobRunner`` built from this environment would use), then handed over as a worker hands
    it: a copy decoded from JSON, or for a typed job (its handler takes a pydantic model; a
    dict or an instance is accepted) the model validated from that JSON, as a worker
    validates it. ``ctx.progress`` is checked as on a worker and kept in memory: pass an
    :class:`InMemoryProgress` as ``progress`` to read every report (``.reports``, ``.value``,
    ``.note``); nothing is coalesced. ``async def`` handlers run to completion on an event loop
    of their own (a fresh ``asyncio.run``, or a loop thread when called from running async
    code).

    A per-tenant job runs its child handler, the one a worker runs for each tenant after the
    fan-out: ``tenant_id`` is required (and checked as a fan-out checks tenant ids), trigger
    ``"fanout"``, message id derived from a wrapper id and the tenant as the fan-out derives
    it. A ``tenant_id`` for any other job is refused: its handler never sees one.

    What the worker's middleware adds is not simulated: no retries (the handler's exception
    propagates unchanged), no hooks, no sequential lock, no dedup key, no ``timeout_ms``, no
    run record. Errors, all raised before the handler runs: :class:`UnknownJobError` (a job
    the registry lacks), :class:`PayloadError` (a bad payload, ``tenant_id`` or ``attempt``,
    naming the job, the field and the value), :class:`JobConfigError` (``registry`` is not a
    :class:`Registry`, or a ``KUMIKO_*`` variable that ``JobRunner(registry)`` would refuse).
    """
    job = _job(registry, job_name)
    name = job.qualified_name
    max_bytes = resolve_settings({}).max_payload_bytes
    body = payload_to_enqueue(job, payload, max_bytes=max_bytes)
    max_attempts = job.options.retries + 1
    if (
        not isinstance(attempt, int)
        or isinstance(attempt, bool)
        or not 1 <= attempt <= max_attempts
    ):
        raise PayloadError(
            name, "attempt", f"must be an integer from 1 to {max_attempts} (retries + 1)", attempt
        )
    message_id = generate_unique_id()
    trigger: Trigger = "manual"
    if job.options.per_tenant:
        if tenant_id is None:
            raise PayloadError(
                name,
                "tenant_id",
                "is required: a per-tenant job runs its handler once per tenant",
                tenant_id,
            )
        problem = tenant_id_problem(tenant_id)
        if problem is not None:
            raise PayloadError(name, "tenant_id", problem, tenant_id)
        message_id = child_message_id(message_id, tenant_id)
        trigger = "fanout"
    elif tenant_id is not None:
        raise PayloadError(
            name, "tenant_id", "must be None: only a per-tenant job runs for a tenant", tenant_id
        )
    meta = JobMeta(attempt=attempt, max_attempts=max_attempts, tenant_id=tenant_id, trigger=trigger)
    sink = InMemoryProgress() if progress is None else progress
    ctx = JobContext(job_name=name, message_id=message_id, meta=meta, app=app, _progress=sink)
    delivered = load_payload(job, json.loads(json.dumps(body)))
    if job.is_async:
        return _run_coroutine(job.handler(delivered, ctx))
    return job.handler(delivered, ctx)


def _job(registry: Registry, job_name: str) -> JobDefinition:
    if not isinstance(registry, Registry):
        raise JobConfigError(None, "registry", "must be a Registry", registry)
    try:
        return registry.jobs[job_name]
    except (KeyError, TypeError):
        raise UnknownJobError(str(job_name), list(registry.jobs)) from None


def _run_coroutine(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # Called from async code (an async test): this thread's loop is busy running the caller,
    # so the handler gets a loop thread of its own, as it would on a worker.
    loop = EventLoopThread("run_job")
    try:
        return loop.run(coro)
    finally:
        loop.stop()


# -- a dataset per test -----------------------------------------------------------------------
def new_queue_prefix(name: str = "test") -> str:
    """A fresh queue prefix: ``name`` made prefix-safe (at most 40 characters) plus 8 random
    hex digits, so no two tests share a dataset."""
    safe = "".join(char if char.isalnum() else "_" for char in name)[:40] or "test"
    if not (safe[0].isalpha() or safe[0] == "_"):
        safe = f"t_{safe}"
    return f"{safe}_{uuid.uuid4().hex[:8]}"


def delete_dataset(client: redis.Redis, queue_prefix: str) -> int:
    """Delete every key of ``queue_prefix`` in ``client``'s database, kumiko's and Dramatiq's
    (queues, delay and dead-letter queues, ack sets, run history, locks, dedup records...);
    return how many. Leaves other prefixes alone. For test datasets: it does not stop a
    worker that is still using them."""
    patterns = (
        keys.root(queue_prefix) + "*",
        queue_list(f"{queue_prefix}-*"),
        consumer_acks("*", f"{queue_prefix}-*"),
    )
    deleted = 0
    for pattern in patterns:
        batch = list(client.scan_iter(match=pattern, count=1000))
        if batch:
            deleted += int(client.delete(*batch))
    return deleted


@contextmanager
def private_redis_server(binary: str = "redis-server") -> Iterator[str]:
    """Start a throwaway ``redis-server`` and yield its URL; stop it and remove its files after.

    It listens on a Unix socket in a new temporary directory (no TCP port, so nothing to
    collide with), saves nothing to disk, and is this caller's alone. Raises
    ``FileNotFoundError`` when ``binary`` is not on ``PATH``, and
    :class:`RedisUnavailableError` when the server does not answer within
    :data:`SERVER_START_TIMEOUT_S`.
    """
    executable = shutil.which(binary)
    if executable is None:
        raise FileNotFoundError(f"{binary} is not on PATH")
    base = Path(tempfile.mkdtemp(prefix="kumiko-redis-"))
    socket_path = base / "redis.sock"
    url = f"unix://{socket_path}?db=0"
    with (base / "redis.log").open("wb") as log:
        server = subprocess.Popen(
            [
                *(executable, "--port", "0", "--unixsocket", str(socket_path)),
                *("--unixsocketperm", "700", "--save", "", "--appendonly", "no"),
                *("--dir", str(base)),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_until_it_answers(url, server)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(base, ignore_errors=True)


def _wait_until_it_answers(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        while True:
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RedisUnavailableError(
                        url, "starting a private redis-server", exc
                    ) from exc
                time.sleep(0.01)
    finally:
        client.close()
