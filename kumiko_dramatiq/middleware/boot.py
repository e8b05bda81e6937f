"""Boot-once jobs and boot gates: the ``Boot`` middleware, the gate loop and the reset.

Boot-once (``run_on_boot=True``): one Lua call (``lua/boot_once.lua``) per job
and start, which in this order

1. returns at once if the job's persistent marker ``keys.boot_marker(prefix,
   job)`` exists;
2. enqueues the message with the fixed id ``ids.boot_message_id(job,
   prefix)`` through the id guard ``keys.enqueue_guard(prefix, id)`` (``SET
   NX PX``, TTL ``retention.completed_age_s``), written with the message;
3. sets the marker (no TTL: it lives as long as the dataset, nothing sweeps
   it), also when the guard already existed, which restores a lost marker
   without enqueuing again.

All three steps are one atomic call, so concurrent starts enqueue once and no
crash can separate the message from its guard or its marker.

Boot gates (``boot_gate=True``): :func:`run_gate` runs a gate in-process,
synchronously, attempt after attempt (``retries + 1`` attempts, the job's
backoff slept between them), calling the runner's hooks with
``meta.trigger == "gate"``. ``timeout_ms`` bounds each attempt: the attempt
runs in a helper thread; when time is up the thread is interrupted like a
Dramatiq actor (an asynchronous ``TimeLimitExceeded``, which cannot stop a
blocking C call) and the attempt fails with that error; the next attempt
starts once the thread ended or after :data:`GATE_INTERRUPT_GRACE_S`,
whichever comes first (a thread stuck in C code is left behind, daemonic).

:func:`reset_boot_marker` (and ``kumiko reset-boot``) deletes a job's marker
and id guard so the next worker start enqueues it again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import redis
from dramatiq.broker import Broker
from dramatiq.message import generate_unique_id
from dramatiq.middleware import Middleware
from dramatiq.middleware.threading import raise_thread_exception
from dramatiq.middleware.time_limit import TimeLimitExceeded

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.acl import check_server
from kumiko_dramatiq.broker.connection import client as redis_client
from kumiko_dramatiq.broker.connection import describe
from kumiko_dramatiq.broker.counts import backfill_counts
from kumiko_dramatiq.broker.faults import kumiko_error
from kumiko_dramatiq.broker.keys import ClusterPrefix
from kumiko_dramatiq.broker.urls import parse as parse_url
from kumiko_dramatiq.context import JobContext, JobMeta
from kumiko_dramatiq.errors import (
    BootGateError,
    JobConfigError,
    RedisUnavailableError,
    redact_url,
)
from kumiko_dramatiq.ids import boot_message_id
from kumiko_dramatiq.messages import build_message
from kumiko_dramatiq.ops.history import RunHistory, RunStatus, error_fields, record_write
from kumiko_dramatiq.options import retry_delay_ms
from kumiko_dramatiq.payloads import empty_payload, load_payload
from kumiko_dramatiq.registry import QUALIFIED_NAME_RE, JobDefinition, Registry
from kumiko_dramatiq.settings import PREFIX_PATTERN
from kumiko_dramatiq.shards.routing import pinned_shard
from kumiko_dramatiq.worker.runtime import Runtime

logger = logging.getLogger("kumiko_dramatiq")

#: How long a timed-out gate attempt's thread gets to unwind after it was
#: interrupted, before the next attempt starts anyway.
GATE_INTERRUPT_GRACE_S = 1.0

#: Exit status of a CLI worker process whose boot failed.
BOOT_FAILED_EXIT_STATUS = 3


def boot_gates(registry: Registry, lane: str) -> list[JobDefinition]:
    """The boot gates of ``lane``, in declaration order."""
    return [j for j in registry.jobs.values() if j.options.boot_gate and j.options.run_in == lane]


def boot_once_jobs(registry: Registry, lane: str) -> list[JobDefinition]:
    """The ``run_on_boot`` jobs of ``lane``, in declaration order."""
    return [j for j in registry.jobs.values() if j.options.run_on_boot and j.options.run_in == lane]


# -- gates -----------------------------------------------------------------
def run_gate(
    runtime: Runtime, job: JobDefinition, *, sleep: Callable[[float], Any] = time.sleep
) -> None:
    """Run boot gate ``job`` until an attempt succeeds; raise :class:`BootGateError`
    after ``retries + 1`` failed attempts.

    Every attempt calls ``on_job_start`` and then ``on_job_complete`` or
    ``on_job_failed`` (with ``meta.final_attempt`` on the last one), under one
    message id per gate run. The handler gets ``payload == {}`` (a typed gate: its
    model validated from ``{}``) and ``ctx.app``.
    """
    backoff = job.options.backoff
    max_attempts = job.options.max_attempts
    message_id = generate_unique_id()
    name = job.qualified_name
    for attempt in range(1, max_attempts + 1):
        meta = JobMeta(attempt=attempt, max_attempts=max_attempts, tenant_id=None, trigger="gate")
        ctx = JobContext(job_name=name, message_id=message_id, meta=meta, app=runtime.app)
        started = datetime.now(UTC)
        _record_gate(runtime, ctx, started, "running", None)
        runtime.call_hook("on_job_start", name, message_id, meta)
        error = _attempt(runtime, job, ctx)
        if error is None:
            _record_gate(runtime, ctx, started, "completed", None)
            runtime.call_hook("on_job_complete", name, message_id, meta)
            logger.info("boot gate %s passed on attempt %d", name, attempt)
            return
        _record_gate(runtime, ctx, started, "dead" if meta.final_attempt else "failed", error)
        runtime.call_hook("on_job_failed", name, message_id, meta, error)
        if meta.final_attempt:
            raise BootGateError(name, attempt, error) from error
        delay_ms = retry_delay_ms(
            None if backoff is None else backoff.type,
            None if backoff is None else backoff.delay_ms,
            attempt,
        )
        logger.warning(
            "boot gate %s: attempt %d of %d failed (%s: %s), retrying in %d ms",
            name,
            attempt,
            max_attempts,
            type(error).__name__,
            error,
            0 if delay_ms is None else delay_ms,
        )
        if delay_ms:
            sleep(delay_ms / 1000)


def _record_gate(
    runtime: Runtime,
    ctx: JobContext,
    started: datetime,
    status: RunStatus,
    error: BaseException | None,
) -> None:
    """Write the run record of one gate attempt (a Redis error is logged, never raised: the
    record is for the operator, the gate's outcome is the start's)."""
    now = datetime.now(UTC)
    fields: dict[str, Any] = {
        "j": ctx.job_name,
        "m": ctx.message_id,
        "o": ctx.message_id,
        "tr": "gate",
        "a": ctx.meta.attempt,
        "ma": ctx.meta.max_attempts,
        "st": int(started.timestamp() * 1000),
        "w": runtime.broker.worker_identity(),
        **error_fields(error),
    }
    if status != "running":
        fields["en"] = int(now.timestamp() * 1000)
        fields["d"] = int((now - started).total_seconds() * 1000)
    history = RunHistory(runtime.broker.client, runtime.broker.lua, runtime.queue_prefix)
    try:
        history.put(record_write(fields, status, runtime.settings), now, runtime.settings)
    except redis.RedisError as exc:
        logger.warning("boot gate %s: could not write its run record (%s)", ctx.job_name, exc)


def _attempt(runtime: Runtime, job: JobDefinition, ctx: JobContext) -> BaseException | None:
    """One attempt of a gate: ``None`` on success, else the error it failed with."""

    def call() -> None:
        runtime.call_handler(job, load_payload(job, empty_payload(job)), ctx)

    timeout_ms = job.options.timeout_ms
    if timeout_ms is None:
        try:
            call()
        except Exception as exc:
            return exc
        return None
    return _attempt_with_timeout(call, job, timeout_ms)


def _attempt_with_timeout(
    call: Callable[[], Any], job: JobDefinition, timeout_ms: int
) -> BaseException | None:
    lock = threading.Lock()
    state: dict[str, Any] = {"finished": False, "error": None}

    def target() -> None:
        try:
            error: BaseException | None = None
            try:
                call()
            except BaseException as exc:
                error = exc
            with lock:
                state["finished"] = True
                state["error"] = error
        except TimeLimitExceeded:
            pass  # interrupted after giving up on it: the attempt failed already

    thread = threading.Thread(target=target, name=f"kumiko-gate-{job.qualified_name}", daemon=True)
    thread.start()
    thread.join(timeout_ms / 1000)
    with lock:
        finished = state["finished"]
        if not finished and thread.ident is not None:
            raise_thread_exception(thread.ident, TimeLimitExceeded)  # type: ignore[no-untyped-call]
    if not finished:
        thread.join(GATE_INTERRUPT_GRACE_S)
        return TimeLimitExceeded(f"boot gate {job.qualified_name} exceeded timeout_ms={timeout_ms}")
    error = state["error"]
    if error is None or isinstance(error, Exception | TimeLimitExceeded):
        return error
    raise error  # KeyboardInterrupt, SystemExit: not a failed attempt


# -- boot-once -------------------------------------------------------------
def reset_boot_marker(
    redis_client_or_url: redis.Redis | str, queue_prefix: str, job_name: str
) -> bool:
    """Forget that boot-once job ``job_name`` was enqueued in dataset ``queue_prefix``.

    Deletes, in one command, the job's boot marker, the id guard of its fixed
    message id and any "already completed" record of that id, so the next
    worker start enqueues the job again. Returns whether anything was
    deleted. When something was, the job's id generation goes one up
    (``keys.boot_generation``): the next run's message id is a new one, so the
    earlier run's records stay in the history. Reset only once the earlier run
    is over (not queued, running or waiting to retry).

    ``redis_client_or_url`` is a ``redis.Redis`` (left open) or a URL (a
    client with bounded timeouts is opened and closed). Raises
    :class:`JobConfigError` for a malformed prefix or job name and
    :class:`RedisUnavailableError` when Redis does not answer.
    """
    if not isinstance(queue_prefix, str) or not PREFIX_PATTERN.fullmatch(queue_prefix):
        raise JobConfigError(
            None, "queue_prefix", f"must match {PREFIX_PATTERN.pattern}", queue_prefix
        )
    if not isinstance(job_name, str) or not QUALIFIED_NAME_RE.fullmatch(job_name):
        raise JobConfigError(
            None, "job_name", "must be a qualified job name 'feature:job:name'", job_name
        )
    if isinstance(redis_client_or_url, str):
        if parse_url(redis_client_or_url).is_cluster:
            queue_prefix = ClusterPrefix(queue_prefix)
        client = redis_client(redis_client_or_url, timeout_s=10, queue_prefix=queue_prefix)
        try:
            return _delete_boot_records(client, redis_client_or_url, queue_prefix, job_name)
        finally:
            client.close()
    return _delete_boot_records(
        redis_client_or_url, describe_client(redis_client_or_url), queue_prefix, job_name
    )


def _delete_boot_records(client: redis.Redis, url: str, queue_prefix: str, job_name: str) -> bool:
    try:
        message_id = boot_message_id(
            job_name, queue_prefix, boot_generation(client, queue_prefix, job_name)
        )
        deleted = client.delete(
            keys.boot_marker(queue_prefix, job_name),
            keys.enqueue_guard(queue_prefix, message_id),
            keys.completed(queue_prefix, message_id),
        )
        if deleted:
            # the next run gets a new id: the run records of this one are kept
            client.execute_command("INCR", keys.boot_generation(queue_prefix, job_name))  # type: ignore[no-untyped-call]
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise RedisUnavailableError(url, f"resetting the boot marker of {job_name}", exc) from exc
    return bool(deleted)


def boot_generation(client: redis.Redis, queue_prefix: str, job_name: str) -> int:
    """How many times boot-once job ``job_name`` was reset (0: never)."""
    raw = client.get(keys.boot_generation(queue_prefix, job_name))
    return int(raw) if raw is not None else 0


def describe_client(client: redis.Redis) -> str:
    """A ``redis://host:port/db`` description of ``client`` for error messages."""
    return describe(client)


# -- the middleware ---------------------------------------------------------
class Boot(Middleware):
    """Boot gates, then boot-once jobs, when a worker process boots.

    Runs :meth:`Boot.run` once per start, before the worker consumes anything:

    1. every ``boot_gate`` job of the runner's lane (``runtime.lane``), in
       declaration order, in-process and synchronously (see
       :func:`kumiko_dramatiq.middleware.boot.run_gate`: ``retries + 1`` attempts, the job's
       backoff slept between them, ``timeout_ms`` per attempt, hooks with
       ``meta.trigger == "gate"``). The first gate that still fails raises
       :class:`~kumiko_dramatiq.errors.BootGateError` (its message includes the
       gate's own error) and nothing after it runs;
    2. every ``run_on_boot`` job of the lane: the message built by
       ``build_message(job, {}, trigger="boot", message_id=ids.boot_message_id(job,
       prefix))`` (a per-tenant job's wrapper; a typed job's ``{}`` is its model's dump of
       ``{}``, :func:`~kumiko_dramatiq.payloads.empty_payload`) goes through
       ``broker.enqueue_step`` with the ``boot_once`` script (``lua/boot_once.lua``):
       check the marker, enqueue through the id guard, set the marker, in one Lua
       call. So it is enqueued once per dataset (Redis DB + queue prefix)
       however many starts, concurrent or not, and its retries (on the fixed id)
       are the ``Retries`` middleware's like any job's.

    ``JobRunner.start()`` sets :attr:`Boot.driven_by_runner` and calls
    :meth:`run` itself, so a failure raises from ``start()`` before its worker
    exists. ``dramatiq kumiko_dramatiq.app`` reaches :meth:`run` through
    ``after_process_boot`` in every worker process; there a failure logs one
    critical line and raises ``SystemExit(3)`` (``emit_after`` swallows only
    ``Exception``), which ends the process before its worker starts, and
    Dramatiq's main process then stops the others and exits non-zero.

    Options read: ``boot_gate``, ``run_on_boot``, ``run_in``, ``retries``,
    ``backoff``, ``timeout_ms``. Message options written: those of
    ``build_message`` with ``kumiko_trigger="boot"``. Redis keys: for each
    boot-once job ``keys.boot_marker(prefix, job)`` (no TTL) and
    ``keys.enqueue_guard(prefix, boot id)`` (TTL ``retention.completed_age_s``),
    plus the lane queue's message hash and list; gates touch none. A lane without
    gates or boot-once jobs makes no Redis call. Second in the chain (after
    ``AgeLimit``); it has no message hooks, so it costs deliveries nothing.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        #: Set by ``JobRunner.start()``, which runs :meth:`run` itself.
        self.driven_by_runner = False

    def after_process_boot(self, broker: Broker) -> None:
        if self.driven_by_runner:
            return
        try:
            check_server(self.runtime.broker, self.runtime.settings.redis_url)
            self.run(broker)
        except Exception as exc:
            url = redact_url(self.runtime.settings.redis_url)
            where = "" if url in str(exc) else f" (Redis at {url})"
            logger.critical(
                "kumiko worker for %s did not start%s: %s",
                self.runtime.queue_name,
                where,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
            raise SystemExit(BOOT_FAILED_EXIT_STATUS) from exc

    def run(self, broker: Broker) -> None:
        """Run the lane's boot gates, then enqueue its boot-once jobs (on a dataset of
        several shards: the gates on shard 0, each boot-once job on its own shard).

        Raises ``BootGateError`` (gates) or ``RedisUnavailableError``.
        """
        try:  # per-job counts over what was written before they were kept
            backfill_counts(self.runtime.broker, self.runtime.queue_name)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise RedisUnavailableError(
                describe_client(self.runtime.broker.client), "counting messages per job", exc
            ) from exc
        except redis.RedisError as exc:  # a refused write: the first read of the counts retries
            logger.warning(
                "per-job counts of %s not filled in yet (%s); the first read of them does it",
                self.runtime.queue_name,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
        settings = self.runtime.settings
        if settings.shard == 0:  # once per process, also when it consumes several shards
            for gate in boot_gates(self.runtime.registry, self.runtime.lane):
                run_gate(self.runtime, gate)
        for job in boot_once_jobs(self.runtime.registry, self.runtime.lane):
            if pinned_shard(job, settings.shards) == settings.shard:  # the job's shard
                self._enqueue_once(job)

    def _enqueue_once(self, job: JobDefinition) -> None:
        runtime = self.runtime
        prefix = runtime.queue_prefix
        broker = runtime.broker
        action = f"enqueuing boot job {job.qualified_name}"
        try:
            generation = boot_generation(broker.client, prefix, job.qualified_name)
        except redis.RedisError as exc:  # a refused command (READONLY, OOM) too
            raise kumiko_error(describe_client(broker.client), action, exc) from exc
        message_id = boot_message_id(job.qualified_name, prefix, generation)
        payload = empty_payload(job, max_bytes=runtime.settings.max_payload_bytes)
        message = build_message(
            job, payload, queue_prefix=prefix, trigger="boot", message_id=message_id
        )
        try:
            _, reply = broker.enqueue_step(
                message,
                broker.lua.boot_once,
                keys=[
                    keys.boot_marker(prefix, job.qualified_name),
                    keys.enqueue_guard(prefix, message_id),
                ],
                args=[runtime.settings.retention.completed_age_s * 1000, message_id],
            )
        except redis.RedisError as exc:
            raise kumiko_error(describe_client(broker.client), action, exc) from exc
        outcome = reply[1]
        if outcome == "enqueued":
            logger.info("boot job %s enqueued as %s", job.qualified_name, message_id)
        elif outcome == "guarded":
            logger.warning(
                "boot job %s: marker was missing but %s was enqueued already; marker restored",
                job.qualified_name,
                message_id,
            )
        else:
            logger.debug("boot job %s was enqueued by an earlier start", job.qualified_name)
