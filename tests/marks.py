"""The "already completed" marks of a dataset, read for tests (``lua/include/marks.lua``)."""

from __future__ import annotations

import redis

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.broker import RESEND_WINDOW_MS


def completed_marks(
    client: redis.Redis, queue_prefix: str, window_ms: int = RESEND_WINDOW_MS
) -> dict[str, int]:
    """Every message id marked "already completed" in dataset ``queue_prefix``, with the PTTL
    (ms) of the set that holds it (the longest, if two do)."""
    marks: dict[str, int] = {}
    for key in client.scan_iter(match=keys.completed_marks(queue_prefix, window_ms) + "*"):
        pttl = int(client.pttl(key))
        for member in client.smembers(key):
            message_id = member.decode() if isinstance(member, bytes) else str(member)
            marks[message_id] = max(marks.get(message_id, pttl), pttl)
    return marks
