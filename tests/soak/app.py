"""The soak's app: every kind of job, each handler recording what it did into Redis.

Workers and schedulers load it as ``KUMIKO_APP=tests.soak.app:runner``: a
``JobRunner`` built from ``KUMIKO_REDIS_URL`` and ``KUMIKO_QUEUE_PREFIX``
whose ``get_active_tenant_ids`` returns :data:`TENANTS`; the driver builds its
producer with :func:`build_runner`.

Record format (one JSON object per ``RPUSH`` onto :func:`records_key`)::

    job        qualified job name
    mid        message id
    attempt    1-based attempt (ctx.attempt)
    tenant     tenant id of a per-tenant child, else null
    sched      the cron tick (UTC epoch seconds), else null
    n          the driver's token of the logical job (payload["n"]), else null
    ev         "start" | "end" | "fail"
    t          time.time() when the record was made
    pid, pgid  the worker process and its process group (= the dramatiq main process)
    run        a random token per handler call (start/end/fail of one call share it)

A handler records ``start``, works (``payload["sleep_ms"]``), then records
``fail`` and raises :class:`SoakFailure` while ``attempt <= payload["fail_first"]``
(for per-tenant children only if its tenant is in ``payload["fail_tenants"]``),
else records ``end``. A record write that meets a dropped connection is retried;
a retried ``RPUSH`` may store a record twice, which the checker folds by ``run``.

The poison job (:data:`POISON`) records ``start`` and then kills its own worker
process: ``os._exit(1)``, or a segfault when ``payload["how"] == "segfault"``.
Only the driver's fault thread dispatches it.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kumiko_dramatiq import Backoff, Cron, Feature, JobContext, JobRunner, RateLimit, Registry

#: The 50 tenants every per-tenant dispatch fans out to.
TENANTS = [f"tenant-{index:02d}" for index in range(50)]
#: retries of every job that may fail (attempts = retries + 1).
RETRIES = 2
#: Fixed backoff between attempts.
BACKOFF_MS = 50
#: How long a sequential run that finds the lock held waits before re-checking.
SEQUENTIAL_RETRY_DELAY_MS = 200

PARALLEL = "soak:job:parallel"
PER_TENANT = "soak:job:per_tenant"
SEQUENTIAL = "soak:job:sequential"
DEDUP = "soak:job:dedup"
TICK = "soak:job:tick"
BOOT = "soak:job:boot"
POISON = "soak:job:poison"
CAPPED = "soak:job:capped"
RATED = "soak:job:rated"
STEP = "soak:job:step"
BATCH_DONE = "soak:job:batch_done"
#: ``soak:job:capped``: at most this many runs at once, across every worker process.
CAPPED_MAX_RUNNING = 2
#: ``soak:job:rated``: at most this many starts in any window of RATED_PER_MS.
RATED_COUNT = 5
RATED_PER_MS = 1_000


class SoakFailure(Exception):
    """The deliberate failure of an attempt the payload asked to fail."""


def records_key(queue_prefix: str) -> str:
    """The list every handler appends its records to (removed with the prefix)."""
    return f"kumiko:{queue_prefix}:soak:runs"


class Recorder:
    """``ctx.app`` of the soak: appends records to Redis (one client per process)."""

    def __init__(self, redis_url: str, queue_prefix: str) -> None:
        self.redis_url = redis_url
        self.queue_prefix = queue_prefix
        self._mutex = threading.Lock()
        self._client: redis.Redis | None = None
        self._pid = 0

    def client(self) -> redis.Redis:
        with self._mutex:
            if self._client is None or self._pid != os.getpid():
                self._client = redis.Redis.from_url(
                    self.redis_url,
                    socket_connect_timeout=5,
                    socket_timeout=10,
                    retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), 8),
                    retry_on_error=[redis.ConnectionError, redis.TimeoutError],
                )
                self._pid = os.getpid()
            return self._client

    def record(self, ctx: JobContext, payload: Mapping[str, Any], event: str, run: str) -> None:
        scheduled = ctx.scheduled_at
        entry = {
            "job": ctx.job_name,
            "mid": ctx.message_id,
            "attempt": ctx.attempt,
            "tenant": ctx.tenant_id,
            "sched": None if scheduled is None else scheduled.timestamp(),
            "n": payload.get("n"),
            "ev": event,
            "t": time.time(),
            "pid": os.getpid(),
            "pgid": os.getpgid(0),
            "run": run,
        }
        self.client().rpush(records_key(self.queue_prefix), json.dumps(entry))


def _run(payload: dict[str, Any], ctx: JobContext, *, may_fail: bool = True) -> None:
    recorder: Recorder = ctx.app
    run = uuid.uuid4().hex
    recorder.record(ctx, payload, "start", run)
    sleep_ms = payload.get("sleep_ms", 0)
    if sleep_ms:
        time.sleep(sleep_ms / 1000)
    if may_fail and ctx.attempt <= payload.get("fail_first", 0):
        recorder.record(ctx, payload, "fail", run)
        raise SoakFailure(
            f"{ctx.job_name} {ctx.message_id}: attempt {ctx.attempt} fails on purpose"
        )
    recorder.record(ctx, payload, "end", run)


soak = Feature("soak")


@soak.job("parallel", retries=RETRIES, backoff=Backoff("fixed", delay_ms=BACKOFF_MS))
def parallel(payload: dict[str, Any], ctx: JobContext) -> None:
    _run(payload, ctx)


@soak.job(
    "per_tenant", per_tenant=True, retries=RETRIES, backoff=Backoff("fixed", delay_ms=BACKOFF_MS)
)
def per_tenant(payload: dict[str, Any], ctx: JobContext) -> None:
    _run(payload, ctx, may_fail=ctx.tenant_id in payload.get("fail_tenants", []))


@soak.job(
    "sequential",
    concurrency="sequential",
    retries=RETRIES,
    backoff=Backoff("fixed", delay_ms=BACKOFF_MS),
)
def sequential(payload: dict[str, Any], ctx: JobContext) -> None:
    _run(payload, ctx)


@soak.job("dedup", retries=RETRIES, backoff=Backoff("fixed", delay_ms=BACKOFF_MS))
def dedup(payload: dict[str, Any], ctx: JobContext) -> None:
    _run(payload, ctx)


@soak.job(
    "capped",
    max_running=CAPPED_MAX_RUNNING,
    retries=RETRIES,
    backoff=Backoff("fixed", delay_ms=BACKOFF_MS),
)
def capped(payload: dict[str, Any], ctx: JobContext) -> None:
    _run(payload, ctx)


@soak.job(
    "rated",
    rate_limit=RateLimit(RATED_COUNT, RATED_PER_MS),
    retries=RETRIES,
    backoff=Backoff("fixed", delay_ms=BACKOFF_MS),
)
def rated(payload: dict[str, Any], ctx: JobContext) -> None:
    _run(payload, ctx)


@soak.job("batch_done", retries=RETRIES, backoff=Backoff("fixed", delay_ms=BACKOFF_MS))
def batch_done(payload: dict[str, Any], ctx: JobContext) -> None:
    """A batch's ``on_complete``: every child it was given has ended, each once, completed
    (their fail_first is below the attempts), in dispatch order; else it fails for good."""
    assert ctx.batch is not None
    got = [(result.status, result.value) for result in ctx.batch.results()]
    wanted = [("completed", n) for n in payload["children"]]
    if got != wanted:
        raise SoakFailure(f"batch {ctx.batch.id}: children ended as {got}, not {wanted}")
    _run(payload, ctx, may_fail=False)


@soak.job("step", retries=RETRIES, backoff=Backoff("fixed", delay_ms=BACKOFF_MS))
def step(payload: dict[str, Any], ctx: JobContext) -> int:
    """A batch child or a chain step: returns its n (a step checks the step before's)."""
    wanted = payload.get("previous")
    if "previous" in payload and ctx.previous_result != wanted:
        raise SoakFailure(f"{ctx.message_id}: previous result {ctx.previous_result}, not {wanted}")
    _run(payload, ctx)
    return int(payload["n"])


@soak.job("tick", trigger=Cron("* * * * * *"))
def tick(payload: dict[str, Any], ctx: JobContext) -> None:
    _run(payload, ctx, may_fail=False)


@soak.job("boot", run_on_boot=True)
def boot(payload: dict[str, Any], ctx: JobContext) -> None:
    _run(payload, ctx, may_fail=False)


@soak.job("poison")
def poison(payload: dict[str, Any], ctx: JobContext) -> None:
    """Record the start, then kill this worker process: a poison message."""
    recorder: Recorder = ctx.app
    recorder.record(ctx, payload, "start", uuid.uuid4().hex)
    if payload.get("how") == "segfault":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the repository
        ctypes.string_at(0)
    os._exit(1)


registry = Registry([soak])


def build_runner(environ: Mapping[str, str]) -> JobRunner:
    """The soak's runner for ``KUMIKO_REDIS_URL`` and ``KUMIKO_QUEUE_PREFIX`` in ``environ``."""
    redis_url = environ.get("KUMIKO_REDIS_URL") or "redis://127.0.0.1:6379/0"
    queue_prefix = environ.get("KUMIKO_QUEUE_PREFIX") or "kumiko"
    return JobRunner(
        registry,
        redis_url=redis_url,
        queue_prefix=queue_prefix,
        context=Recorder(redis_url, queue_prefix),
        get_active_tenant_ids=lambda: TENANTS,
        worker_threads=4,
        sequential_retry_delay_ms=SEQUENTIAL_RETRY_DELAY_MS,
    )


#: What ``KUMIKO_APP=tests.soak.app:runner`` names (construction opens no connection).
runner = build_runner(os.environ)
