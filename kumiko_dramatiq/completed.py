""" "Already completed": a message id that completed never runs again.

Every way a second copy of a completed message id could reach a worker is closed where the
copy would be made, in the same Lua call as the step that could leave it behind:

- a due delayed message moves from its delay queue to its queue in one step
  (``lua/move.lua``), not Dramatiq's enqueue-then-ack (a kill in between left a copy);
- a retry and a sequential hand-off are written by the ack of the delivery they follow
  (``lua/settle.lua``), so a redelivered message never finds its own follow-up already out;
- a delivery recovered by maintenance from a worker presumed dead that then finished it
  takes its recovered copy back at its ack if no other worker took it yet (``settle.lua``);
- every other write of a new message sits behind a "sent" marker for the resend window
  (:data:`~kumiko_dramatiq.broker.RESEND_WINDOW_MS`), so a command re-sent after a dropped
  connection writes nothing twice.

What remains is at-least-once delivery itself: a worker killed after a handler returned but
before its ack re-runs that message once, and a copy recovered from a worker presumed dead
(``heartbeat_timeout_ms`` of silence) and taken by another worker before the first one's ack
runs on both. No marker can stop those (the second run starts before the first ends).

As a safety net for copies written within the resend window, the ack of a completed run
also writes ``keys.completed(prefix, message id)`` (:func:`mark_completed`, same Lua call, no
round trip of its own), kept ``KumikoBroker.completed_ttl_ms`` (the resend window, one
minute), and every fetch from a lane queue acks unrun a message whose id carries one (logged
at WARNING). So Redis holds about a minute of markers, not a day: memory follows the backlog,
not the throughput. Reset: ``DEL`` the key.
"""

from __future__ import annotations

from .broker import Settlement


def mark_completed(settlement: Settlement) -> None:
    """Ask the ack to write the "already completed" marker of this delivery's message id.

    Touches no Redis key itself: the ack's Lua call (``lua/settle.lua``) does, with the
    marker TTL the broker was built with.
    """
    settlement.completed = True
