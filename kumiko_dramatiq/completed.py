""" "Already completed" markers: a message id that completed never runs again.

A second copy of a finished message id can reach a worker: a message recovered by
Dramatiq's maintenance from a worker presumed dead that in fact finished it, or a copy
written twice. So:

- **written by the ack**: when a kumiko run completes (not handed off, no exception), the
  ``History`` middleware calls :func:`mark_completed` on the delivery's settlement, and the
  consumer's ack writes ``keys.completed(prefix, message id)`` with a TTL of
  ``Retention.completed_age_s`` in the same Lua call as the ack (``lua/settle.lua``): no round
  trip of its own;
- **checked by the fetch**: fetching from a lane queue checks each fetched message's marker
  inside the fetch's own Lua call (``lua/fetch_lane.lua``) and acks, without running it, a message
  whose id carries one (logged at WARNING by the consumer). Delay queues are not checked:
  their messages are checked when they come due.

A worker killed after a handler returned but before its ack still re-runs that message
once (delivery is at least once): the marker is written by the ack. Reset: ``DEL`` the key
(``kumiko reset-boot`` does it for a boot job's fixed id).
"""

from __future__ import annotations

from .broker import Settlement


def mark_completed(settlement: Settlement) -> None:
    """Ask the ack to write the "already completed" marker of this delivery's message id.

    Touches no Redis key itself: the ack's Lua call (``lua/settle.lua``) does, with the
    marker TTL the broker was built with.
    """
    settlement.completed = True
