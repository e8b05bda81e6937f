"""Dedup keys: the record that ties a key to the life of ONE job, and the producer side.

A dedup key ``k`` of job ``j`` has at most one record, a Redis hash at
:func:`kumiko_dramatiq.keys.dedup` (``kumiko:{prefix}:dedup:{job}:{k}``)::

    id        the live message id (the job the key currently stands for)
    state     "queued"   queued, delayed, or waiting out a retry backoff
              "running"  a worker runs it
              "ending"   its run ended for good and its follow-up is being enqueued
    fid       the follow-up's message id (only once a trigger arrived during a run)
    fpayload  the follow-up's payload (JSON): the latest trigger's
    ftrigger  the follow-up's trigger ("manual" | "event"): the latest trigger's

Producer decision (:func:`dispatch_with_key`, ONE Lua call that also writes
the message): no record -> write ``{id, queued}`` and enqueue; ``queued`` ->
return ``id``; ``running`` -> the first trigger allocates ``fid`` (its own
message id), every later one returns it and replaces ``fpayload``;
``ending`` -> return ``fid``. The worker side (``middleware.dedup.Dedup``)
moves the record along and frees it, compare-and-delete, when the job ends
for good.

Lifetime: every write by the worker and the producer's creation set the
record's TTL to :func:`record_ttl_ms`, a bound on the whole remaining life
of the job (runs, retries, backoffs, queue waits, one crash recovery per
attempt). A producer hit never extends it, so a record whose message was
lost for good frees itself however many triggers keep arriving.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import redis
from redis.commands.core import Script

from . import keys
from .broker import AtomicStep
from .context import Trigger
from .errors import PayloadError
from .messages import build_message
from .options import Event
from .registry import JobDefinition
from .runtime import Runtime
from .scripts import PRELUDE

#: Message option that marks a message as the live job of a dedup key.
DEDUP_KEY_OPTION = "kumiko_dedup_key"

#: Run bound assumed for a run without ``timeout_ms`` (and for per-tenant
#: wrappers, which have no time limit): 1 h.
DEFAULT_RUN_BOUND_MS = 3_600_000
#: How far past ``timeout_ms`` a run may go: Dramatiq's ``TimeLimit`` checks
#: about once a second.
TIMEOUT_GRACE_MS = 1_000
#: Added once to every bound: time spent waiting in a backed-up queue or for
#: Dramatiq's crash recovery to notice a dead worker: 1 h.
QUEUE_SLACK_MS = 3_600_000

#: How a delivery of a keyed message ends, as far as its key is concerned.
Outcome = Literal["end", "retry", "handoff"]


def record_ttl_ms(
    *,
    timeout_ms: int | None,
    max_attempts: int,
    retry_window_ms: int,
    heartbeat_timeout_ms: int,
    delay_ms: int = 0,
) -> int:
    """TTL of a dedup record: the longest a keyed job can still be alive.

    ``delay_ms + max_attempts * (run_bound_ms + heartbeat_timeout_ms)
    + retry_window_ms + QUEUE_SLACK_MS`` where ``run_bound_ms`` is
    ``timeout_ms + TIMEOUT_GRACE_MS``, or ``DEFAULT_RUN_BOUND_MS`` without a
    timeout. Each attempt may run its full bound and be cut short by a crash
    that Dramatiq notices after ``heartbeat_timeout_ms``; backoffs add at most
    ``retry_window_ms``; a delayed dispatch waits ``delay_ms`` first. Pure.
    """
    for name, value in (
        ("max_attempts", max_attempts),
        ("retry_window_ms", retry_window_ms),
        ("heartbeat_timeout_ms", heartbeat_timeout_ms),
        ("delay_ms", delay_ms),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    run_bound_ms = DEFAULT_RUN_BOUND_MS if timeout_ms is None else timeout_ms + TIMEOUT_GRACE_MS
    return (
        delay_ms
        + max(max_attempts, 1) * (run_bound_ms + heartbeat_timeout_ms)
        + retry_window_ms
        + QUEUE_SLACK_MS
    )


def job_record_ttl_ms(job: JobDefinition, *, heartbeat_timeout_ms: int, delay_ms: int = 0) -> int:
    """:func:`record_ttl_ms` for ``job``'s keyed message (a per-tenant job's is
    its wrapper, which has no time limit)."""
    options = job.options
    return record_ttl_ms(
        timeout_ms=None if options.per_tenant else options.timeout_ms,
        max_attempts=options.max_attempts,
        retry_window_ms=options.retry_window_ms(),
        heartbeat_timeout_ms=heartbeat_timeout_ms,
        delay_ms=delay_ms,
    )


def delivery_outcome(*, handed_off: bool, failed: bool, final_attempt: bool) -> Outcome:
    """What the end of one delivery means for its key. Pure.

    ``handoff``: a sequential run handed off to a new message (the key
    follows it); ``retry``: a failed attempt that will be retried on the same
    id (the key stays, back to ``queued``); ``end``: the job ended for good
    (success, or failure on the final attempt): free the key or start the
    follow-up.
    """
    if handed_off:
        return "handoff"
    if failed and not final_attempt:
        return "retry"
    return "end"


def check_dedup_key(job_name: str, field: str, key: Any) -> str:
    """Return ``key`` if it is a non-empty string, else raise :class:`PayloadError`."""
    if not isinstance(key, str) or not key:
        raise PayloadError(job_name, field, "must be a non-empty string", key)
    return key


def event_dedup_keys(jobs: Sequence[JobDefinition], payload: dict[str, Any]) -> list[str | None]:
    """The dedup key of each job for an event ``payload`` (``None``: no key function).

    Computes and checks every key before the caller enqueues anything; a key
    function that raises or returns anything but a non-empty string is a
    :class:`PayloadError` naming the job.
    """
    result: list[str | None] = []
    for job in jobs:
        trigger = job.options.trigger
        key_fn = trigger.dedup_key if isinstance(trigger, Event) else None
        if key_fn is None:
            result.append(None)
            continue
        try:
            key = key_fn(payload)
        except Exception as exc:
            raise PayloadError(
                job.qualified_name,
                "trigger.dedup_key",
                f"raised {type(exc).__name__}: {exc} for the payload",
                payload,
            ) from exc
        result.append(check_dedup_key(job.qualified_name, "trigger.dedup_key", key))
    return result


# -- Lua ---------------------------------------------------------------------

#: enqueue_atomic step. KEYS[3] = record; ARGV[3] = TTL ms, ARGV[4] = this
#: message's id, ARGV[5] = payload JSON, ARGV[6] = trigger.
#: Returns {1, id} (enqueued) or {0, id of the job the key stands for}.
DISPATCH = """
local record = KEYS[3]
local live = redis.call("hmget", record, "id", "state", "fid")
if not live[1] then
    redis.call("del", record)
    redis.call("hset", record, "id", ARGV[4], "state", "queued")
    redis.call("pexpire", record, ARGV[3])
    enqueue_message()
    return {1, ARGV[4]}
end
if live[2] == "running" then
    local fid = live[3] or ARGV[4]
    redis.call("hset", record, "fid", fid, "fpayload", ARGV[5], "ftrigger", ARGV[6])
    return {0, fid}
end
if live[2] == "ending" and live[3] then
    return {0, live[3]}
end
return {0, live[1]}
"""

#: KEYS[1] = record; ARGV[1] = message id, ARGV[2] = TTL ms.
#: Marks the record running iff it points at this message. Returns 1 or 0.
MARK_RUNNING = """
if redis.call("hget", KEYS[1], "id") ~= ARGV[1] then
    return 0
end
redis.call("hset", KEYS[1], "state", "running")
redis.call("pexpire", KEYS[1], ARGV[2])
return 1
"""

#: KEYS[1] = record; ARGV[1] = message id, ARGV[2] = next live id, ARGV[3] = TTL ms.
#: Iff the record points at this message: point it at ARGV[2] (a retry: the
#: same id; a sequential hand-off: the requeued id), state queued; a pending
#: follow-up stays. Returns 1 or 0.
REQUEUE = """
if redis.call("hget", KEYS[1], "id") ~= ARGV[1] then
    return 0
end
redis.call("hset", KEYS[1], "id", ARGV[2], "state", "queued")
redis.call("pexpire", KEYS[1], ARGV[3])
return 1
"""

#: KEYS[1] = record; ARGV[1] = message id, ARGV[2] = TTL ms.
#: The job ended for good. Iff the record points at this message: without a
#: follow-up delete it ({"freed"}); with one, freeze it as "ending" and
#: return {"follow-up", fid, fpayload, ftrigger}. Else {"gone"}.
FINISH = """
local rec = redis.call("hmget", KEYS[1], "id", "fid", "fpayload", "ftrigger")
if rec[1] ~= ARGV[1] then
    return {"gone"}
end
if not rec[2] then
    redis.call("del", KEYS[1])
    return {"freed"}
end
redis.call("hset", KEYS[1], "state", "ending")
redis.call("pexpire", KEYS[1], ARGV[2])
return {"follow-up", rec[2], rec[3], rec[4]}
"""

#: enqueue_atomic step. KEYS[3] = record; ARGV[3] = ending message id,
#: ARGV[4] = follow-up id, ARGV[5] = TTL ms. Iff the record is still this
#: message's "ending" with this follow-up: enqueue the follow-up and make it
#: the live job (queued). Returns {1} or {0}.
HANDOVER = """
local rec = redis.call("hmget", KEYS[3], "id", "state", "fid")
if rec[1] ~= ARGV[3] or rec[2] ~= "ending" or rec[3] ~= ARGV[4] then
    return {0}
end
enqueue_message()
redis.call("del", KEYS[3])
redis.call("hset", KEYS[3], "id", ARGV[4], "state", "queued")
redis.call("pexpire", KEYS[3], ARGV[5])
return {1}
"""


@dataclass(frozen=True)
class DedupScripts:
    """The dedup scripts, registered on one broker's client."""

    dispatch: Script
    mark_running: Script
    requeue: Script
    finish: Script
    handover: Script

    @classmethod
    def register(cls, client: redis.Redis) -> DedupScripts:
        return cls(
            dispatch=client.register_script(PRELUDE + DISPATCH),
            mark_running=client.register_script(MARK_RUNNING),
            requeue=client.register_script(REQUEUE),
            finish=client.register_script(FINISH),
            handover=client.register_script(PRELUDE + HANDOVER),
        )


def scripts_for(runtime: Runtime) -> DedupScripts:
    """The scripts registered for ``runtime``'s broker (held by its ``Dedup`` middleware)."""
    from .middleware.dedup import Dedup

    for middleware in runtime.broker.middleware:
        if isinstance(middleware, Dedup):
            return middleware.scripts
    return DedupScripts.register(runtime.broker.client)


# -- producer ----------------------------------------------------------------


def dispatch_with_key(
    runtime: Runtime,
    job: JobDefinition,
    payload: dict[str, Any],
    dedup_key: str,
    *,
    trigger: Trigger,
    delay_ms: int | None,
) -> str:
    """Enqueue ``job`` under ``dedup_key`` unless a live job holds the key; return the id.

    One Lua call decides and (if the key is free) writes record and message
    together. While the keyed job is queued, delayed or waiting out a retry:
    its id, nothing enqueued. While it runs: the id of its one follow-up,
    whose payload becomes ``payload``; the follow-up starts without delay
    when the run ends, so ``delay_ms`` applies only to a fresh enqueue.
    """
    broker = runtime.broker
    message = build_message(
        job,
        payload,
        queue_prefix=runtime.queue_prefix,
        trigger=trigger,
        extra_options={DEDUP_KEY_OPTION: dedup_key},
    )
    ttl_ms = job_record_ttl_ms(
        job,
        heartbeat_timeout_ms=broker.heartbeat_timeout,
        delay_ms=0 if delay_ms is None else delay_ms,
    )
    step = AtomicStep(
        scripts_for(runtime).dispatch,
        keys=[keys.dedup(runtime.queue_prefix, job.qualified_name, dedup_key)],
        args=[ttl_ms, str(message.message_id), json.dumps(payload), trigger],
    )
    _, reply = broker.enqueue_atomic(message, step, delay=delay_ms)
    return str(reply[1])
