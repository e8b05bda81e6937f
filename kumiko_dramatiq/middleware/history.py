"""History: the end record of each attempt, for the ack to write; "already completed".

The run history (:mod:`kumiko_dramatiq.ops.history`) keeps one record per attempt. This
middleware prepares the record of each attempt's end for the one Lua call that settles the
delivery (``lua/settle.lua``); no round trip of its own.

"Already completed": a message id that completed never runs again. Every way a second copy
of a completed message id could reach a worker is closed where the copy would be made, in
the same Lua call as the step that could leave it behind:

- a due delayed message moves from its delay queue to its queue in one step
  (``lua/move.lua``), not Dramatiq's enqueue-then-ack (a kill in between left a copy);
- a retry and a sequential hand-off are written by the ack of the delivery they follow
  (``lua/settle.lua``), so a redelivered message never finds its own follow-up already out;
- a delivery recovered by maintenance from a worker presumed dead that then finished it
  takes its recovered copy back at its ack if no other worker took it yet (``settle.lua``);
- every other write of a new message is guarded for the resend window
  (:data:`~kumiko_dramatiq.broker.broker.RESEND_WINDOW_MS`), so a command re-sent after a dropped
  connection writes nothing twice: on a lane queue by its body while it waits or runs, then by
  the "sent" tombstone its end leaves (a retry, a hand-off, a dead letter, a cancel; a
  completion leaves the marker below instead); elsewhere by a "sent" marker set when written.

What remains is at-least-once delivery itself: a worker killed after a handler returned but
before its ack re-runs that message once, and a copy recovered from a worker presumed dead
(``heartbeat_timeout_ms`` of silence) and taken by another worker before the first one's ack
runs on both. No marker can stop those (the second run starts before the first ends).

As the guard of a completed message (and a safety net for other copies written within the
resend window), the ack of a completed run
also writes ``keys.completed(prefix, message id)`` (:func:`mark_completed`, same Lua call, no
round trip of its own), kept ``KumikoBroker.completed_ttl_ms`` (the resend window, one
minute), and every fetch from a lane queue acks unrun a message whose id carries one (logged
at WARNING). So Redis holds about a minute of markers, not a day: memory follows the backlog,
not the throughput. Reset: ``DEL`` the key.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware

from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.broker.delivery import Delivery, RunWrite, Settlement
from kumiko_dramatiq.ops.history import RunStatus, error_fields
from kumiko_dramatiq.settings import Settings
from kumiko_dramatiq.worker.execution import Execution, execution_of
from kumiko_dramatiq.workflows.batches import batch_write
from kumiko_dramatiq.workflows.results import result_write

logger = logging.getLogger("kumiko_dramatiq")


def mark_completed(settlement: Settlement) -> None:
    """Ask the ack to write the "already completed" marker of this delivery's message id.

    Touches no Redis key itself: the ack's Lua call (``lua/settle.lua``) does, with the
    marker TTL the broker was built with.
    """
    settlement.completed = True


def end_record(
    execution: Execution,
    status: RunStatus,
    *,
    exception: BaseException | None,
    settings: Settings,
    worker: str,
) -> RunWrite:
    """What the settle call writes for the end of ``execution``'s attempt."""
    now_ms = int(time.time() * 1000)
    options, meta = execution.options, execution.meta
    started_ms = int(execution.started_at * 1000)
    origin = options.origin_id or execution.message_id
    record: dict[str, Any] = {
        # "d" first: the settle script reads it off the record for the stats (a plain search
        # that stops at the first "d" key, lua/include/history.lua)
        "d": max(0, now_ms - started_ms),
        "j": execution.job.qualified_name,
        "m": execution.message_id,
        "o": origin,
        "tr": options.trigger,
        "a": meta.attempt,
        "ma": meta.max_attempts,
        "s": status,
        "q": execution.delivery.message.message_timestamp,
        "st": started_ms,
        "en": now_ms,
        "w": worker,
    }
    if options.tenant_id is not None:
        record["t"] = options.tenant_id
    if options.scheduled_at is not None:
        record["sa"] = options.scheduled_at.isoformat()
    if options.dedup_key is not None:
        record["dk"] = options.dedup_key
    if options.batch is not None:  # its batch (the dashboard links a child's run to it)
        record["b"] = options.batch
    elif options.batch_callback is not None:
        record["cb"] = options.batch_callback
    if exception is not None:
        record.update(error_fields(exception))
    if settings.record_payloads:
        record["p"] = execution.delivery.message.args[0]
    dead_note = ""
    if status == "dead":
        dead_note = json.dumps(
            {
                "r": execution.delivery.redis_message_id,
                "q": execution.delivery.fetched_from,
                **{k: record.get(k) for k in ("j", "m", "o", "t", "a", "ma", "et", "em", "tb")},
                "at": now_ms,
            }
        )
    return RunWrite(
        message_id=execution.message_id,
        attempt=meta.attempt,
        job=execution.job.qualified_name,
        status=status,
        tenant=options.tenant_id or "",
        origin=origin,
        record=json.dumps(record, separators=(",", ":"), default=str),
        dead_note=dead_note,
        started_ms=started_ms,
    )


def handoff_record(execution: Execution) -> RunWrite:
    """Drop the "running" record of a delivery that handed off (no attempt happened)."""
    return RunWrite(
        message_id=execution.message_id,
        attempt=execution.meta.attempt,
        job=execution.job.qualified_name,
        status="",
        tenant="",
        origin=execution.origin_id,
        record="",
        dead_note="",
    )


class History(Middleware):
    """Prepares the end record of every kumiko attempt for the ack that writes it, and asks
    the ack to write the "already completed" marker of a completed run
    (:mod:`kumiko_dramatiq.middleware.history`).

    The end of an attempt of a job that keeps results hands the settle its value (or tells
    its waiters it died): :func:`~kumiko_dramatiq.workflows.results.result_write`; the end of a
    batch child or callback is counted by its batch in the same call
    (:func:`~kumiko_dramatiq.workflows.batches.batch_write`).

    Before ``Retries`` in the chain (after ``Boot``, ``Metrics``, ``Tracing``), so its
    ``after_process_message`` runs after
    ``Retries`` decided (a retry on the settlement = failed; ``message.failed`` = dead). A
    hand-off writes no record, nor does a fenced run (its message runs again). Touches no Redis
    key itself (the settle call does).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        execution = execution_of(message)
        if execution is None or not isinstance(message, Delivery):
            return
        if execution.handed_off:
            message.settlement.run = handoff_record(execution)
            return
        if execution.fenced:
            return  # no attempt ended: the message goes back to its queue (Sequential)
        status: RunStatus = "completed"
        if execution.stopped:  # runner.stop_run: ends cancelled, never runs again
            status = "cancelled"
            mark_completed(message.settlement)
        elif exception is not None:
            status = "dead" if message.failed else "failed"
        else:
            mark_completed(message.settlement)
        message.settlement.run = end_record(
            execution, status, exception=exception, settings=self.settings, worker=_worker(broker)
        )
        message.settlement.result = result_write(execution, status)
        message.settlement.batch = batch_write(execution)
        if status == "completed" and logger.isEnabledFor(logging.DEBUG):
            # its arguments (a dict, a clock read) cost more than the check: every run
            logger.debug(
                "%s %s completed in %d ms (attempt %d of %d)",
                execution.job.qualified_name,
                execution.message_id,
                int((time.time() - execution.started_at) * 1000),
                execution.meta.attempt,
                execution.meta.max_attempts,
                extra=execution.log_fields(),
            )

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        execution = execution_of(message)
        if execution is not None and isinstance(message, Delivery):
            status: RunStatus = "dead" if message.failed else "completed"
            message.settlement.run = end_record(
                execution, status, exception=None, settings=self.settings, worker=_worker(broker)
            )
            message.settlement.result = result_write(execution, status)
            message.settlement.batch = batch_write(execution)


def _worker(broker: Broker) -> str:
    return broker.worker_identity() if isinstance(broker, KumikoBroker) else "?"
