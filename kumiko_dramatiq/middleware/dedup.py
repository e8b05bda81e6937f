"""``Dedup``: the worker side of dedup keys, moving each key's record along its job's life.

Acts only on messages that carry ``kumiko_dedup_key`` (set by
:func:`kumiko_dramatiq.dedup.dispatch_with_key`; on a per-tenant job only the
wrapper carries it): every other message returns before any Redis call.
Reads the message options ``kumiko_dedup_key``, ``kumiko_retries`` and
``kumiko_failures`` (through ``Execution.meta``) and, after a sequential
hand-off, ``Execution.notes["sequential.requeued_id"]``. Writes no message
option of its own; a follow-up it enqueues is built by ``build_message`` with
``kumiko_dedup_key``. Touches one Redis key per keyed message:
:func:`kumiko_dramatiq.keys.dedup` (the record described in
:mod:`kumiko_dramatiq.dedup`), plus the queue keys of a follow-up.

Place: after ``Sequential`` and before ``Hooks``, so ``before_process_message``
sees whether the run handed off, and the record is marked running before
``on_job_start``; after-hooks run in reverse, so the key is released after
``on_job_complete``/``on_job_failed`` and before ``Retries`` enqueues a retry.

Transitions (each one Lua call that first checks the record still points at
this message id, and refreshes its TTL, :func:`~kumiko_dramatiq.dedup.record_ttl_ms`, in ms):

- ``before_process_message``: mark ``running`` (a hand-off is not a run).
- ``after_process_message``: success or a failure on the final attempt ends
  the job: delete the record, or, if a trigger arrived during the run, enqueue
  the follow-up through ``KumikoBroker.enqueue_atomic`` (one more Lua call that
  writes the message and makes it the live job) ; a failure that will be
  retried sets ``queued`` (the retry keeps the id); a sequential hand-off
  points the record at the requeued message, ``queued``.
- ``after_skip_message`` (a malformed message dead-lettered, any skip): the
  job ended for good, as above.

Redis errors: a failed transition is logged and never stops the message; the
record then frees itself at its TTL (the run itself goes ahead even if it
could not be marked running: a trigger during it then collapses into it).
"""

from __future__ import annotations

import json
import logging
from functools import cached_property
from typing import Any, cast

from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware

from .. import keys
from ..broker import AtomicStep
from ..context import Trigger
from ..dedup import (
    DEDUP_KEY_OPTION,
    DedupScripts,
    Outcome,
    delivery_outcome,
    job_record_ttl_ms,
)
from ..messages import build_message, wrapper_actor_name
from ..registry import JobDefinition
from ..runtime import Runtime

logger = logging.getLogger("kumiko_dramatiq")

#: Where ``Sequential`` leaves the id of the message it handed off to.
REQUEUED_ID_NOTE = "sequential.requeued_id"


class Dedup(Middleware):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        #: actor name -> (job, is the per-tenant wrapper)
        self._actors: dict[str, tuple[JobDefinition, bool]] = {}
        for job in runtime.registry.jobs.values():
            self._actors[job.qualified_name] = (job, False)
            if job.options.per_tenant:
                self._actors[wrapper_actor_name(job)] = (job, True)

    @cached_property
    def scripts(self) -> DedupScripts:
        """The dedup scripts on this runner's broker (registered on first use)."""
        return DedupScripts.register(self.runtime.broker.client)

    # -- hooks ---------------------------------------------------------------
    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        keyed = self._keyed(message)
        if keyed is None:
            return
        execution = self.runtime.current()
        if execution is None or execution.handed_off:
            return
        job, dedup_key = keyed
        message_id = str(message.message_id)
        try:
            owned = self.scripts.mark_running(
                keys=[self._record(job, dedup_key)], args=[message_id, self._ttl_ms(job)]
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
        keyed = self._keyed(message)
        if keyed is None:
            return
        execution = self.runtime.current()
        if execution is None:
            return
        outcome = delivery_outcome(
            handed_off=execution.handed_off,
            failed=exception is not None,
            final_attempt=execution.meta.final_attempt,
        )
        self._transition(*keyed, str(message.message_id), outcome, execution.notes)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        keyed = self._keyed(message)
        if keyed is None:
            return
        message_id = str(message.message_id)
        execution = self.runtime.current()
        if execution is not None and execution.message_id == message_id and execution.handed_off:
            self._transition(*keyed, message_id, "handoff", execution.notes)
        else:
            self._transition(*keyed, message_id, "end", {})

    # -- transitions -----------------------------------------------------------
    def _transition(
        self,
        job: JobDefinition,
        dedup_key: str,
        message_id: str,
        outcome: Outcome,
        notes: dict[str, Any],
    ) -> None:
        record = self._record(job, dedup_key)
        ttl_ms = self._ttl_ms(job)
        try:
            if outcome == "retry":
                self.scripts.requeue(keys=[record], args=[message_id, message_id, ttl_ms])
                return
            if outcome == "handoff":
                requeued_id = notes.get(REQUEUED_ID_NOTE)
                if isinstance(requeued_id, str) and requeued_id:
                    self.scripts.requeue(keys=[record], args=[message_id, requeued_id, ttl_ms])
                    return
                logger.warning(
                    "%s %s handed off without a requeued id; freeing dedup key %r",
                    job.qualified_name,
                    message_id,
                    dedup_key,
                )
            self._finish(job, dedup_key, record, message_id, ttl_ms)
        except Exception:
            logger.exception(
                "%s %s: could not update dedup key %r (%s); it frees itself within %d ms",
                job.qualified_name,
                message_id,
                dedup_key,
                outcome,
                ttl_ms,
            )

    def _finish(
        self, job: JobDefinition, dedup_key: str, record: str, message_id: str, ttl_ms: int
    ) -> None:
        """The job ended for good: free the key, or hand it to the pending follow-up."""
        reply = _decoded(self.scripts.finish(keys=[record], args=[message_id, ttl_ms]))
        if reply[0] != "follow-up":
            return
        follow_up_id, payload_json, trigger = reply[1], reply[2], reply[3]
        follow_up = build_message(
            job,
            json.loads(payload_json),
            queue_prefix=self.runtime.queue_prefix,
            trigger=cast(Trigger, trigger),
            message_id=follow_up_id,
            extra_options={DEDUP_KEY_OPTION: dedup_key},
        )
        step = AtomicStep(
            self.scripts.handover, keys=[record], args=[message_id, follow_up_id, ttl_ms]
        )
        _, result = self.runtime.broker.enqueue_atomic(follow_up, step)
        if result[0] == 1:
            logger.info(
                "%s %s ended; follow-up %s enqueued for dedup key %r",
                job.qualified_name,
                message_id,
                follow_up_id,
                dedup_key,
            )

    # -- helpers ---------------------------------------------------------------
    def _keyed(self, message: MessageProxy) -> tuple[JobDefinition, str] | None:
        """(job, key) if ``message`` holds a dedup key, else ``None`` (no Redis call)."""
        options = message.options
        if not isinstance(options, dict):
            return None
        dedup_key = options.get(DEDUP_KEY_OPTION)
        if not isinstance(dedup_key, str) or not dedup_key:
            return None
        found = self._actors.get(message.actor_name)
        if found is None:
            return None
        job, is_wrapper = found
        if job.options.per_tenant and not is_wrapper:
            return None  # a per-tenant key covers the wrapper, never a child
        return job, dedup_key

    def _record(self, job: JobDefinition, dedup_key: str) -> str:
        return keys.dedup(self.runtime.queue_prefix, job.qualified_name, dedup_key)

    def _ttl_ms(self, job: JobDefinition) -> int:
        return job_record_ttl_ms(job, heartbeat_timeout_ms=self.runtime.broker.heartbeat_timeout)


def _decoded(reply: Any) -> list[Any]:
    items = reply if isinstance(reply, list) else [reply]
    return [item.decode() if isinstance(item, bytes) else item for item in items]
