"""Waiting messages by priority level (``kumiko jobs``, ``runner.waiting_by_priority()``).

A lane queue's messages with a priority or a fair key wait in its order
(``lua/include/route.lua``), counted by level as they enter and leave it
(``keys.queue_levels``); level 0's messages without a key wait on the queue's list. One round
trip, a few keys per lane, whatever the queues' size.
"""

from __future__ import annotations

import redis

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.options import LANES, lane_queue

#: The levels, 0 (runs first) to 9.
LEVELS = tuple(range(10))


def waiting_by_priority(client: redis.Redis, queue_prefix: str) -> dict[str, dict[int, int]]:
    """Per lane, per level: the messages waiting to start (not delayed, parked or waiting for
    a cap; those ``cancel`` or ``purge`` withdrew left out)."""
    pipe = client.pipeline(transaction=True)
    for lane in LANES:
        queue = lane_queue(queue_prefix, lane)
        pipe.hgetall(keys.queue_levels(queue))
        pipe.llen(keys.queue_list(queue))
        pipe.scard(keys.queue_withdrawn(queue))
    replies = iter(pipe.execute())
    out: dict[str, dict[int, int]] = {}
    for lane in LANES:
        levels, listed, withdrawn = next(replies), int(next(replies)), int(next(replies))
        fields = {text(name): int(count) for name, count in levels.items()}
        counts = dict.fromkeys(LEVELS, 0)
        withdrawn_in_order = 0
        for level in LEVELS:
            gone = max(0, fields.get(f"w{level}", 0))
            withdrawn_in_order += gone
            counts[level] = max(0, fields.get(str(level), 0) - gone)
        # level 0's messages without a key wait on the queue's list
        counts[0] += max(0, listed - max(0, withdrawn - withdrawn_in_order))
        out[lane] = counts
    return out
