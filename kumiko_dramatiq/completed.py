""" "Already completed" markers: a message id that completed never runs again.

A second copy of a finished message id can reach a worker: a message recovered by
Dramatiq's maintenance from a worker presumed dead that in fact finished it, or a copy
written twice. So:

- **written by the ack**: when a kumiko run completes (not handed off, no exception), the
  :class:`Completed` middleware sets the delivery's settlement, and the consumer's ack writes
  ``keys.completed(prefix, message id)`` with a TTL of ``Retention.completed_age_s`` in the
  same Lua call as the ack (``lua/ack.lua``): no round trip of its own;
- **checked by the fetch**: fetching from a lane queue checks each fetched message's marker
  inside the fetch's own Lua call (``lua/fetch.lua``) and acks, without running it, a message
  whose id carries one (logged at WARNING by the consumer). Delay queues are not checked:
  their messages are checked when they come due.

A worker killed after a handler returned but before its ack still re-runs that message
once (delivery is at least once): the marker is written by the ack. Reset: ``DEL`` the key
(``kumiko reset-boot`` does it for a boot job's fixed id).
"""

from __future__ import annotations

from typing import Any

from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware

from .execution import execution_of


class Completed(Middleware):
    """Asks the ack to write the "already completed" marker of every completed kumiko run.

    Touches no Redis key itself (the ack does). Right after ``Executions`` in the chain.
    """

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        execution = execution_of(message)
        if exception is None and execution is not None and not execution.handed_off:
            execution.delivery.settlement.completed = True
