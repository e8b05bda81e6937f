"""Dedup keys: the record that ties a key to the life of ONE job, producer and worker side.

A dedup key ``k`` of job ``j`` has at most one record, a Redis hash at
:func:`kumiko_dramatiq.broker.keys.dedup` (``kumiko:{prefix}:dedup:{job}:{k}``)::

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
``ending`` -> return ``fid``. The worker side (:class:`Dedup`, below) moves the record
along and frees it, compare-and-delete, when the job ends for good.

Lifetime: every write by the worker and the producer's creation set the
record's TTL to :func:`record_ttl_ms`, a bound on the whole remaining life
of the job (runs, retries, backoffs, queue waits, one crash recovery per
attempt). A producer hit never extends it, so a record whose message was
lost for good frees itself however many triggers keep arriving.

Index: every script that writes a record's TTL or deletes it keeps the record's
entry in the job's index (:func:`kumiko_dramatiq.broker.keys.dedup_index`, a sorted
set of keys by the record's expiry), so ``kumiko dedup`` and the dashboard list
live keys in pages without walking the keyspace
(``lua/include/dedup_index.lua``). A producer hit, which writes no TTL, writes
no index entry either.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, Literal, cast

import redis
from dramatiq.broker import Broker, MessageProxy
from dramatiq.message import Message
from dramatiq.middleware import Middleware

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.delivery import Delivery
from kumiko_dramatiq.broker.replies import as_list
from kumiko_dramatiq.codec import DEDUP_KEY
from kumiko_dramatiq.context import Trigger
from kumiko_dramatiq.errors import PayloadError
from kumiko_dramatiq.limits import check_dedup_key
from kumiko_dramatiq.messages import build_message
from kumiko_dramatiq.middleware.metrics import count_dedup, dedup_outcome
from kumiko_dramatiq.options import Event, retry_window_ms
from kumiko_dramatiq.registry import JobDefinition
from kumiko_dramatiq.worker.execution import Execution, execution_of
from kumiko_dramatiq.worker.runtime import Runtime

logger = logging.getLogger("kumiko_dramatiq")

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
        retry_window_ms=retry_window_ms(options),
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


# -- producer ------------------------------------------------------------------


def dispatch_with_key(
    runtime: Runtime,
    job: JobDefinition,
    payload: dict[str, Any],
    dedup_key: str,
    *,
    trigger: Trigger,
    delay_ms: int | None,
    priority: int | None = None,
    fair_key: str | None = None,
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
        dedup_key=dedup_key,
        priority=priority,
        fair_key=fair_key,
    )
    ttl_ms = job_record_ttl_ms(
        job,
        heartbeat_timeout_ms=broker.heartbeat_timeout,
        delay_ms=0 if delay_ms is None else delay_ms,
    )
    _, reply = broker.enqueue_step(
        message,
        broker.lua.dedup_dispatch,
        keys=[
            keys.dedup(runtime.queue_prefix, job.qualified_name, dedup_key),
            keys.dedup_index(runtime.queue_prefix, job.qualified_name),
        ],
        args=[ttl_ms, str(message.message_id), json.dumps(payload), trigger, dedup_key],
        delay=delay_ms,
    )
    own_id = str(message.message_id)
    outcome = dedup_outcome(enqueued=reply[0] == 1, returned_id=str(reply[1]), own_id=own_id)
    count_dedup(broker, job.qualified_name, [outcome])
    return str(reply[1])


#: How often a debounced dispatch builds its message again under the live message's id
#: (another debounced dispatch of the key between its two calls makes it build again).
DEBOUNCE_ATTEMPTS = 3


def dispatch_debounced(
    runtime: Runtime,
    job: JobDefinition,
    payload: dict[str, Any],
    dedup_key: str,
    *,
    trigger: Trigger,
    debounce_ms: int,
    max_wait_ms: int | None,
    priority: int | None = None,
    fair_key: str | None = None,
) -> str:
    """:func:`dispatch_with_key` with debounce (``lua/dedup_debounce.lua``): while the keyed
    job has not started (it waits on the schedule), this payload replaces its payload and its
    start moves to now + ``debounce_ms``, never later than ``max_wait_ms`` after the first
    dispatch of the key; the live id comes back. A first dispatch of the key writes the
    message due in ``debounce_ms``. Once it was moved onto its queue, runs or ends, the
    dedup rules apply. The replacement is built under the live message's id (its redis id is
    derived from it), so a dispatch that finds one builds its message again: at most
    :data:`DEBOUNCE_ATTEMPTS` calls."""
    broker = runtime.broker
    ttl_ms = job_record_ttl_ms(
        job,
        heartbeat_timeout_ms=broker.heartbeat_timeout,
        delay_ms=max(debounce_ms, max_wait_ms or 0),
    )
    message_id: str | None = None
    for _ in range(DEBOUNCE_ATTEMPTS):
        message = build_message(
            job,
            payload,
            queue_prefix=runtime.queue_prefix,
            trigger=trigger,
            message_id=message_id,
            dedup_key=dedup_key,
            priority=priority,
            fair_key=fair_key,
        )
        _, reply = broker.enqueue_step(
            message,
            broker.lua.dedup_debounce,
            keys=[
                keys.dedup(runtime.queue_prefix, job.qualified_name, dedup_key),
                keys.dedup_index(runtime.queue_prefix, job.qualified_name),
            ],
            args=[
                ttl_ms,
                str(message.message_id),
                json.dumps(payload),
                trigger,
                dedup_key,
                "" if max_wait_ms is None else max_wait_ms,
            ],
            delay=debounce_ms,
        )
        if reply[0] != 2:
            break
        message_id = str(reply[1])
    own_id = str(message.message_id)
    outcome = dedup_outcome(enqueued=reply[0] == 1, returned_id=str(reply[1]), own_id=own_id)
    count_dedup(broker, job.qualified_name, [outcome])
    return str(reply[1])


def dispatch_many_with_keys(
    runtime: Runtime,
    job: JobDefinition,
    payloads: Sequence[dict[str, Any]],
    dedup_keys: Sequence[str],
    *,
    trigger: Trigger,
    delay_ms: int | None,
    priority: int | None = None,
    fair_key: str | None = None,
) -> list[str]:
    """:func:`dispatch_with_key` for many payloads of ``job``, in order, in ONE Lua call
    (``lua/dedup_dispatch_batch.lua``); a key given twice stands for its first message."""
    broker = runtime.broker
    messages = [
        build_message(
            job,
            payload,
            queue_prefix=runtime.queue_prefix,
            trigger=trigger,
            dedup_key=key,
            priority=priority,
            fair_key=fair_key,
        )
        for payload, key in zip(payloads, dedup_keys, strict=True)
    ]
    ttl_ms = job_record_ttl_ms(
        job,
        heartbeat_timeout_ms=broker.heartbeat_timeout,
        delay_ms=0 if delay_ms is None else delay_ms,
    )
    reply = broker.enqueue_batch(
        messages,
        broker.lua.dedup_dispatch_batch,
        args=[ttl_ms, trigger, keys.dedup_index(runtime.queue_prefix, job.qualified_name)],
        leads=[keys.dedup(runtime.queue_prefix, job.qualified_name, key) for key in dedup_keys],
        tails=[
            (str(message.message_id), json.dumps(payload), key)
            for message, payload, key in zip(messages, payloads, dedup_keys, strict=True)
        ],
        delay=delay_ms,
    )
    ids = [str(reply[i]) for i in range(1, len(reply), 2)]
    outcomes = [
        dedup_outcome(enqueued=reply[2 * n] == 1, returned_id=ids[n], own_id=str(m.message_id))
        for n, m in enumerate(messages)
    ]
    count_dedup(broker, job.qualified_name, outcomes)
    return ids


# -- worker ----------------------------------------------------------------------


class Dedup(Middleware):
    """The worker side of dedup keys: moves each key's record along its job's life.

    Acts only on messages that carry ``kumiko_dedup_key`` (set by
    :func:`kumiko_dramatiq.middleware.dedup.dispatch_with_key`; on a per-tenant job only the
    wrapper carries it): every other message returns before any Redis call.
    Reads the message options ``kumiko_dedup_key``, ``kumiko_retries`` and
    ``kumiko_failures`` (through ``Execution.meta``) and, after a sequential
    hand-off, ``Execution.handoff_id``. Writes no message
    option of its own; a follow-up it enqueues is built by ``build_message`` with
    ``kumiko_dedup_key``. Touches one Redis key per keyed message:
    :func:`kumiko_dramatiq.broker.keys.dedup` (the record described in
    :mod:`kumiko_dramatiq.middleware.dedup`) and its entry in the job's index
    (:func:`kumiko_dramatiq.broker.keys.dedup_index`), plus the queue keys of a follow-up.

    Place: after ``Sequential`` and before ``Hooks``, so ``before_process_message``
    sees whether the run handed off, and the record is marked running before
    ``on_job_start``; after-hooks run in reverse, so the key is released after
    ``on_job_complete``/``on_job_failed`` and before ``Retries`` enqueues a retry (a key
    freed by the ack is freed after every after-hook).

    Transitions (each one Lua call that first checks the record still points at
    this message id, and refreshes its TTL, :func:`record_ttl_ms`, in ms):

    - ``before_process_message``: mark ``running`` (a hand-off is not a run).
    - ``after_process_message``: success or a failure on the final attempt ends
      the job: delete the record, or, if a trigger arrived during the run, enqueue
      the follow-up through ``KumikoBroker.enqueue_step`` (one more Lua call that
      writes the message and makes it the live job). For a delivery of a lane queue
      (every kumiko job's) the delete is written by the delivery's ack, the settle call
      that happens anyway (``Settlement.dedup``, ``lua/settle.lua``: no round trip of its
      own, and atomic with the ack, so a ``kill -9`` between the two cannot free the key of
      a message that then runs again); a record holding a follow-up makes that settle write
      nothing of the delivery, and the ack hands the key over as above
      (``Settlement.hand_over_dedup``) before it settles the delivery again, so a kill in
      between leaves the message to be redelivered, never acknowledged with its follow-up
      not enqueued. A failure that will be
      retried sets ``queued`` (the retry keeps the id); a sequential hand-off
      points the record at the requeued message, ``queued``; a run fenced because its lease
      could not be renewed leaves the record as it is (the message runs again on its id,
      as after a crash).
    - ``after_skip_message`` (any skip) and :meth:`release_rejected` (a malformed
      message dead-lettered at fetch, before it ran): the job ended for good, as above.

    Redis errors: a failed transition is logged and never stops the message; it goes to
    the worker's retry list (:class:`~kumiko_dramatiq.worker.supervision.Deferred`), which
    writes it once Redis answers, so a key stays blocked no longer than the outage and a
    few seconds; if the worker stops first, the record frees itself at its TTL (the run
    itself goes ahead even if it could not be marked running: a trigger during it then
    collapses into it).
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    # -- hooks ---------------------------------------------------------------
    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        execution = execution_of(message)
        if execution is None or execution.handed_off:
            return
        keyed = self._keyed(execution.job, execution.is_wrapper, execution.options.dedup_key)
        if keyed is None:
            return
        job, dedup_key = keyed
        message_id = execution.message_id
        try:
            owned = self.runtime.broker.lua.dedup_mark_running(
                keys=[self._record(job, dedup_key), self._index(job)],
                args=[message_id, self._ttl_ms(job), dedup_key],
            )
        except Exception:
            logger.exception(
                "%s %s: could not mark dedup key %r running; running anyway",
                job.qualified_name,
                message_id,
                dedup_key,
            )
            return
        if not owned:
            logger.info(
                "%s %s runs without dedup key %r: the key moved on to another message",
                job.qualified_name,
                message_id,
                dedup_key,
            )

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        execution = execution_of(message)
        if execution is None or execution.fenced:
            return  # a fenced run comes back on the same id: its record stays as it is
        keyed = self._keyed(execution.job, execution.is_wrapper, execution.options.dedup_key)
        if keyed is None:
            return
        outcome = delivery_outcome(
            handed_off=execution.handed_off,
            failed=exception is not None,
            final_attempt=execution.meta.final_attempt,
        )
        if (
            outcome == "end"
            and isinstance(message, Delivery)
            and self.runtime.broker.is_lane(message.fetched_from)
        ):
            # a lane delivery's ack is a settle call: it frees the key (lua/settle.lua), no
            # round trip of its own; a key holding a follow-up is handed over first, by the
            # ack (Settlement.hand_over_dedup), before the delivery is settled
            job, dedup_key = keyed
            message_id = execution.message_id
            message.settlement.dedup = (self._index(job), message_id, dedup_key)
            message.settlement.dedup_hand_over = lambda: self._transition(
                job, dedup_key, message_id, "end", execution
            )
            return
        self._transition(*keyed, execution.message_id, outcome, execution)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        execution = execution_of(message)
        if execution is None:
            self.release_rejected(message)
            return
        keyed = self._keyed(execution.job, execution.is_wrapper, execution.options.dedup_key)
        if keyed is not None:
            outcome: Outcome = "handoff" if execution.handed_off else "end"
            self._transition(*keyed, execution.message_id, outcome, execution)

    def release_rejected(self, message: Message[Any] | MessageProxy) -> None:
        """A message dead-lettered before it ran (malformed): free its dedup key, if it holds
        one of ours, so it never blocks later dispatches."""
        found = self.runtime.registry.actor(message.actor_name)
        options = message.options
        raw = options.get(DEDUP_KEY) if isinstance(options, dict) else None
        keyed = None if found is None else self._keyed(*found, raw)
        if keyed is not None:
            self._transition(*keyed, str(message.message_id), "end", None)

    # -- transitions -----------------------------------------------------------
    def _transition(
        self,
        job: JobDefinition,
        dedup_key: str,
        message_id: str,
        outcome: Outcome,
        execution: Execution | None,
    ) -> None:
        handoff_id = None if execution is None else execution.handoff_id
        ttl_ms = self._ttl_ms(job)
        try:
            self._apply(job, dedup_key, message_id, outcome, handoff_id)
        except redis.RedisError as exc:
            # Redis is away: the worker's retry list writes it once Redis answers (each
            # script checks the record still points at this message, so late is safe)
            logger.warning(
                "%s %s: could not update dedup key %r (%s: %s); retrying until Redis takes it",
                job.qualified_name,
                message_id,
                dedup_key,
                outcome,
                " ".join(str(exc).split())[:200],
            )
            self.runtime.deferred.add(
                f"{job.qualified_name} {message_id}: dedup key {dedup_key!r} ({outcome})",
                lambda: self._apply(job, dedup_key, message_id, outcome, handoff_id),
                bound_ms=ttl_ms,
            )
        except Exception:
            logger.exception(
                "%s %s: could not update dedup key %r (%s); it frees itself within %d ms",
                job.qualified_name,
                message_id,
                dedup_key,
                outcome,
                ttl_ms,
            )

    def _apply(
        self,
        job: JobDefinition,
        dedup_key: str,
        message_id: str,
        outcome: Outcome,
        handoff_id: str | None,
    ) -> None:
        """One transition's writes (idempotent: each script checks the owner first)."""
        record = self._record(job, dedup_key)
        index = self._index(job)
        ttl_ms = self._ttl_ms(job)
        lua = self.runtime.broker.lua
        if outcome == "retry":
            lua.dedup_requeue(
                keys=[record, index], args=[message_id, message_id, ttl_ms, dedup_key]
            )
            return
        if outcome == "handoff":
            if handoff_id is not None:
                lua.dedup_requeue(
                    keys=[record, index], args=[message_id, handoff_id, ttl_ms, dedup_key]
                )
                return
            logger.warning(
                "%s %s handed off without a hand-off id; freeing dedup key %r",
                job.qualified_name,
                message_id,
                dedup_key,
            )
        self._finish(job, dedup_key, record, message_id, ttl_ms)

    def _finish(
        self, job: JobDefinition, dedup_key: str, record: str, message_id: str, ttl_ms: int
    ) -> None:
        """The job ended for good: free the key, or hand it to the pending follow-up."""
        broker = self.runtime.broker
        index = self._index(job)
        reply = as_list(
            broker.lua.dedup_finish(keys=[record, index], args=[message_id, ttl_ms, dedup_key])
        )
        if reply[0] != "follow-up":
            return
        follow_up_id, payload_json, trigger = reply[1], reply[2], reply[3]
        follow_up = build_message(
            job,
            json.loads(payload_json),
            queue_prefix=self.runtime.queue_prefix,
            trigger=cast(Trigger, trigger),
            message_id=follow_up_id,
            dedup_key=dedup_key,
        )
        _, result = broker.enqueue_step(
            follow_up,
            broker.lua.dedup_handover,
            keys=[record, index],
            args=[message_id, follow_up_id, ttl_ms, dedup_key],
        )
        if result[0] == 1:
            logger.info(
                "%s %s ended; follow-up %s enqueued for dedup key %r",
                job.qualified_name,
                message_id,
                follow_up_id,
                dedup_key,
            )

    # -- helpers ---------------------------------------------------------------
    @staticmethod
    def _keyed(
        job: JobDefinition, is_wrapper: bool, dedup_key: Any
    ) -> tuple[JobDefinition, str] | None:
        """(job, key) if the delivery holds a dedup key, else ``None`` (no Redis call)."""
        if not isinstance(dedup_key, str) or not dedup_key:
            return None
        if job.options.per_tenant and not is_wrapper:
            return None  # a per-tenant key covers the wrapper, never a child
        return job, dedup_key

    def _record(self, job: JobDefinition, dedup_key: str) -> str:
        return keys.dedup(self.runtime.queue_prefix, job.qualified_name, dedup_key)

    def _index(self, job: JobDefinition) -> str:
        return keys.dedup_index(self.runtime.queue_prefix, job.qualified_name)

    def _ttl_ms(self, job: JobDefinition) -> int:
        return job_record_ttl_ms(job, heartbeat_timeout_ms=self.runtime.broker.heartbeat_timeout)
