"""Lua scripts that write a guard (or a dedup record) and a message in one step.

Each follows the convention of :mod:`kumiko_dramatiq.broker`: ``KEYS[1]`` =
queue message hash, ``KEYS[2]`` = queue list, ``ARGV[1]`` = redis message
id, ``ARGV[2]`` = encoded message; own keys and args follow. The prelude
defines ``enqueue_message()``, which writes exactly what Dramatiq's own
``enqueue`` command writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from redis.commands.core import Script

PRELUDE = """
local function enqueue_message()
    redis.call("hset", KEYS[1], ARGV[1], ARGV[2])
    redis.call("rpush", KEYS[2], ARGV[1])
end
"""

#: Dramatiq's enqueue, made idempotent per redis message id: KEYS[3] = its
#: "sent" marker, ARGV[3] = the marker's TTL in ms. A call re-sent by the
#: client after a dropped connection (redis-py re-sends once), or a second
#: move of the same delayed message, finds the marker and does nothing.
#: Returns {1} or {0}.
ENQUEUE_ONCE = """
if redis.call("exists", KEYS[3]) == 1 then
    return {0}
end
enqueue_message()
redis.call("set", KEYS[3], "1", "PX", ARGV[3])
return {1}
"""

#: Dramatiq's ack of a failed attempt and the enqueue of its retry, in one
#: call, so a crash can neither lose the retry nor enqueue it twice.
#: KEYS[1] = the consumer's ack set, KEYS[2] = the delivered message's hash,
#: KEYS[3] = the retry queue's hash, KEYS[4] = the retry queue's list,
#: KEYS[5] = heartbeats; ARGV[1] = delivered redis id, ARGV[2] = retry redis
#: id, ARGV[3] = encoded retry, ARGV[4] = now (ms), ARGV[5] = worker id.
#: If the delivered message is no longer ours (recovered by another worker
#: while this one was presumed dead), nothing happens: it runs again there.
#: Returns 1 (acked and retried) or 0.
ACK_AND_RETRY = """
redis.call("zadd", KEYS[5], ARGV[4], ARGV[5])
if redis.call("srem", KEYS[1], ARGV[1]) == 0 then
    return 0
end
redis.call("hdel", KEYS[2], ARGV[1])
redis.call("hset", KEYS[3], ARGV[2], ARGV[3])
redis.call("rpush", KEYS[4], ARGV[2])
return 1
"""

#: KEYS[3] = guard key; ARGV[3] = guard TTL in ms, ARGV[4] = guard value.
#: Enqueues the message only if the guard did not exist. Returns {1} or {0}.
#: Every guarded script writes the message BEFORE its guard: Lua scripts do
#: not roll back, so an error while writing the message (a wrong-type key)
#: must not leave a guard that would silently block the message for good.
GUARDED_ENQUEUE = """
if redis.call("exists", KEYS[3]) == 1 then
    return {0}
end
enqueue_message()
redis.call("set", KEYS[3], ARGV[4], "PX", ARGV[3])
return {1}
"""

#: Many messages of ONE queue, each behind its own guard, in one call.
#: ARGV[1] = guard TTL in ms, ARGV[2] = guard value, then per message the
#: triple (guard key, redis message id, encoded message). Guard keys travel
#: in ARGV (as Dramatiq's own script builds its keys), so this targets a
#: single Redis, not a cluster. Returns one 1 (enqueued) or 0 per message.
GUARDED_ENQUEUE_BATCH = """
local enqueued = {}
for i = 3, #ARGV, 3 do
    if redis.call("exists", ARGV[i]) == 0 then
        redis.call("hset", KEYS[1], ARGV[i + 1], ARGV[i + 2])
        redis.call("rpush", KEYS[2], ARGV[i + 1])
        redis.call("set", ARGV[i], ARGV[2], "PX", ARGV[1])
        enqueued[#enqueued + 1] = 1
    else
        enqueued[#enqueued + 1] = 0
    end
end
return enqueued
"""

#: Dramatiq's ack plus the "already completed" marker, in one call.
#: KEYS[1] = consumer acks set, KEYS[2] = queue message hash, KEYS[3] =
#: completed marker, KEYS[4] = heartbeats; ARGV[1] = redis message id,
#: ARGV[2] = marker TTL in ms, ARGV[3] = now (ms), ARGV[4] = worker id.
ACK_COMPLETED = """
redis.call("zadd", KEYS[4], ARGV[3], ARGV[4])
if redis.call("srem", KEYS[1], ARGV[1]) > 0 then
    redis.call("hdel", KEYS[2], ARGV[1])
end
redis.call("set", KEYS[3], "1", "PX", ARGV[2])
"""


@dataclass(frozen=True)
class Scripts:
    """The scripts of one broker, registered on its client."""

    enqueue_once: Script
    ack_and_retry: Script
    guarded_enqueue: Script
    guarded_enqueue_batch: Script
    ack_completed: Script

    @classmethod
    def register(cls, client: redis.Redis) -> Scripts:
        return cls(
            enqueue_once=client.register_script(PRELUDE + ENQUEUE_ONCE),
            ack_and_retry=client.register_script(ACK_AND_RETRY),
            guarded_enqueue=client.register_script(PRELUDE + GUARDED_ENQUEUE),
            guarded_enqueue_batch=client.register_script(GUARDED_ENQUEUE_BATCH),
            ack_completed=client.register_script(ACK_COMPLETED),
        )
