"""Caps: the slot leases of jobs with ``max_running``, renewed and fenced while their runs last.

What the caps are (``max_running``, ``rate_limit``) and how they are kept is the fetch's
work: ``lua/fetch_lane.lua`` with ``lua/include/caps.lua`` claims a capped job's message only
when a slot is free and its rate limit's window allows, taking the slot (a lease: an owner
token ``"<redis id>#<delivery>"`` with a TTL of ``lock_ttl_ms`` in the job's
:func:`~kumiko_dramatiq.broker.keys.cap_slots`) in the same call; a message that finds its job
at a cap is not claimed at all but waits, in arrival order, in its group's list (no worker
thread, no prefetch room, no attempt spent) until a slot is given back (the settle of the
holder looks at the waiters at once: it claims the oldest for its own consumer, whose worker
thread has just finished, or rings the queue's doorbell for them) or the window opens (the
fetch tells the consumer when, and the consumer's idle wait ends then). The slot is given back
by the delivery's settle on every outcome (completed, failed and retried, dead, handed off,
cancelled by ``stop_run``), by ``lua/slot_release.lua`` when a delivery goes back to its queue
(a worker's shutdown, a fenced run), and by its lease running out when its worker dies
(the next fetch that looks reclaims it).

This middleware keeps the lease alive while the run lasts, exactly as ``Sequential`` keeps a
lock's (:class:`~kumiko_dramatiq.middleware.sequential.LeaseRenewer`, one Lua call for all
slots of the process every TTL/3), and fences the run by it
(:mod:`kumiko_dramatiq.worker.fencing`): a run whose slot could not be renewed for
``0.75 * ttl`` is interrupted and comes back like a run cut short by a crash (no attempt
spent; its slot is given back), and one still executing at ``0.9 * ttl`` ends its worker
process, so a slot is never held twice, also when its holder is cut off from Redis.

Place in the chain: just before ``Sequential``, so the fence covers the whole run (the hooks
and ``TimeLimit`` come after), and (``after_*`` hooks run in reverse) the renewal stops after
everything else ran. A per-tenant wrapper takes no slot (the fetch gives it none); its
children do. Messages without a slot return before anything is done. No Redis call of its own
but the renewals: taking and giving back ride on the fetch and the settle.
"""

from __future__ import annotations

from typing import Any

from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware
from dramatiq.worker import Worker

from kumiko_dramatiq.broker.delivery import Delivery
from kumiko_dramatiq.middleware.sequential import LeaseRenewer
from kumiko_dramatiq.worker.execution import execution_of
from kumiko_dramatiq.worker.runtime import Runtime


class Caps(Middleware):
    """Renews and fences the slot lease of a capped job's run (see the module docstring)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.lock_ttl_ms = runtime.settings.lock_ttl_ms
        self._renewer = LeaseRenewer(self, "capped job slots")

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        if not isinstance(message, Delivery) or message.slot is None:
            return
        execution = execution_of(message)
        if execution is None:
            return
        slots_key, token = message.slot
        self._renewer.hold(
            token,
            slots_key,
            sent_at=message.slot_sent_at,
            run=execution.interruptible,
            what=f"{execution.job.qualified_name} {execution.message_id} (slot {token})",
        )

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self._done(message)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._done(message)

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self._renewer.stop()

    def _done(self, message: MessageProxy) -> None:
        if not isinstance(message, Delivery) or message.slot is None:
            return
        self._renewer.release(message.slot[1])
        execution = execution_of(message)
        if execution is not None and execution.fenced:
            # cut short like a crash: back to its queue, no attempt spent; its slot is given
            # back with it (the token is this delivery's own)
            message.settlement.requeue = True
