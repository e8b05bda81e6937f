"""Boot-once jobs and boot gates: the Lua step, the gate loop and the reset.

Boot-once (``run_on_boot=True``): one Lua call (:data:`BOOT_ONCE`) per job
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
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from dramatiq.message import generate_unique_id
from dramatiq.middleware.threading import raise_thread_exception
from dramatiq.middleware.time_limit import TimeLimitExceeded

from . import keys
from .context import JobContext, JobMeta
from .errors import BootGateError, JobConfigError, RedisUnavailableError
from .ids import boot_message_id
from .options import build_message_options, retry_delay_ms
from .registry import JobDefinition, Registry
from .runtime import Runtime

logger = logging.getLogger("kumiko_dramatiq")

#: KEYS[3] = boot marker, KEYS[4] = id guard; ARGV[3] = guard TTL in ms,
#: ARGV[4] = marker and guard value (the fixed message id).
#: Returns {1, "enqueued"}, {0, "marked"} (marker present) or {0, "guarded"}
#: (marker missing, guard present: the marker is restored, nothing enqueued).
BOOT_ONCE = """
if redis.call("exists", KEYS[3]) == 1 then
    return {0, "marked"}
end
local fresh = redis.call("exists", KEYS[4]) == 0
if fresh then
    enqueue_message()
    redis.call("set", KEYS[4], ARGV[4], "PX", ARGV[3])
end
redis.call("set", KEYS[3], ARGV[4])
if fresh then
    return {1, "enqueued"}
end
return {0, "guarded"}
"""

#: How long a timed-out gate attempt's thread gets to unwind after it was
#: interrupted, before the next attempt starts anyway.
GATE_INTERRUPT_GRACE_S = 1.0

_QUALIFIED_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]*:job:[A-Za-z][A-Za-z0-9_-]*")
_PREFIX_RE = re.compile(r"[A-Za-z_][A-Za-z0-9._-]*")


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
    message id per gate run. The handler gets ``payload == {}`` and
    ``ctx.app``.
    """
    options = build_message_options(job)
    max_attempts = job.options.max_attempts
    message_id = generate_unique_id()
    name = job.qualified_name
    for attempt in range(1, max_attempts + 1):
        meta = JobMeta(attempt=attempt, max_attempts=max_attempts, tenant_id=None, trigger="gate")
        ctx = JobContext(job_name=name, message_id=message_id, meta=meta, app=runtime.app)
        runtime.call_hook("on_job_start", name, message_id, meta)
        error = _attempt(runtime, job, ctx)
        if error is None:
            runtime.call_hook("on_job_complete", name, message_id, meta)
            logger.info("boot gate %s passed on attempt %d", name, attempt)
            return
        runtime.call_hook("on_job_failed", name, message_id, meta, error)
        if meta.final_attempt:
            raise BootGateError(name, attempt, error) from error
        delay_ms = retry_delay_ms(options, attempt)
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


def _attempt(runtime: Runtime, job: JobDefinition, ctx: JobContext) -> BaseException | None:
    """One attempt of a gate: ``None`` on success, else the error it failed with."""
    timeout_ms = job.options.timeout_ms
    if timeout_ms is None:
        try:
            runtime.call_handler(job, {}, ctx)
        except Exception as exc:
            return exc
        return None
    return _attempt_with_timeout(lambda: runtime.call_handler(job, {}, ctx), job, timeout_ms)


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
    deleted. Reset only once the earlier run is over (not queued, running or
    waiting to retry): the new message has the same id as the old one.

    ``redis_client_or_url`` is a ``redis.Redis`` (left open) or a URL (a
    client with bounded timeouts is opened and closed). Raises
    :class:`JobConfigError` for a malformed prefix or job name and
    :class:`RedisUnavailableError` when Redis does not answer.
    """
    if not isinstance(queue_prefix, str) or not _PREFIX_RE.fullmatch(queue_prefix):
        raise JobConfigError(
            None, "queue_prefix", "must match [A-Za-z_][A-Za-z0-9._-]*", queue_prefix
        )
    if not isinstance(job_name, str) or not _QUALIFIED_RE.fullmatch(job_name):
        raise JobConfigError(
            None, "job_name", "must be a qualified job name 'feature:job:name'", job_name
        )
    if isinstance(redis_client_or_url, str):
        client = redis.Redis.from_url(
            redis_client_or_url, socket_connect_timeout=5, socket_timeout=10
        )
        try:
            return _delete_boot_records(client, redis_client_or_url, queue_prefix, job_name)
        finally:
            client.close()
    return _delete_boot_records(
        redis_client_or_url, describe(redis_client_or_url), queue_prefix, job_name
    )


def _delete_boot_records(client: redis.Redis, url: str, queue_prefix: str, job_name: str) -> bool:
    message_id = boot_message_id(job_name, queue_prefix)
    try:
        deleted = client.delete(
            keys.boot_marker(queue_prefix, job_name),
            keys.enqueue_guard(queue_prefix, message_id),
            keys.completed(queue_prefix, message_id),
        )
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise RedisUnavailableError(url, f"resetting the boot marker of {job_name}", exc) from exc
    return bool(deleted)


def describe(client: redis.Redis) -> str:
    """A ``redis://host:port/db`` description of ``client`` for error messages."""
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    return f"redis://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"
