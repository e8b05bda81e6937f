"""Per-job message counts: the backfill that makes them exact over older data.

Every script that writes or deletes a message body keeps its queue's counts hash
(``keys.queue_counts``, ``lua/include/counts.lua``). Data written before the counts were kept
(an upgrade) is counted once by :func:`backfill_counts`, in bounded steps
(``lua/counts_backfill.lua``), at a worker's start and at the first read of the counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dramatiq.common import dq_name

from kumiko_dramatiq.broker import keys

if TYPE_CHECKING:
    from kumiko_dramatiq.broker.broker import KumikoBroker

#: Entries one backfill step reads at most (about 2 ms of Redis).
BACKFILL_STEP = 200


def in_order(levels: Any) -> int:
    """How many ids the lists of a lane queue's order hold (priorities and fair keys,
    ``lua/include/route.lua``; ids ``cancel`` withdrew included, as on the queue's list), from
    its ``keys.queue_levels`` hash (``HGETALL``)."""
    return sum(max(0, int(count)) for level, count in (levels or {}).items() if level.isdigit())


def backfill_counts(broker: KumikoBroker, queue_name: str) -> int:
    """Make ``queue_name``'s counts exact (one Lua call when they are already); the number
    of steps it took."""
    steps = 0
    while True:
        steps += 1
        done = broker.lua.counts_backfill(
            keys=[
                keys.queue_counts(queue_name),
                keys.queue_messages(queue_name),
                keys.queue_messages(dq_name(queue_name)),
                keys.dead_letter_messages(queue_name),
            ],
            args=[BACKFILL_STEP],
        )
        if done:
            return steps
