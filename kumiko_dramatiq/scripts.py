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

#: KEYS[3] = guard key; ARGV[3] = guard TTL in ms, ARGV[4] = guard value.
#: Enqueues the message only if the guard did not exist. Returns {1} or {0}.
GUARDED_ENQUEUE = """
if redis.call("set", KEYS[3], ARGV[4], "NX", "PX", ARGV[3]) then
    enqueue_message()
    return {1}
end
return {0}
"""


@dataclass(frozen=True)
class Scripts:
    """The scripts of one broker, registered on its client."""

    guarded_enqueue: Script

    @classmethod
    def register(cls, client: redis.Redis) -> Scripts:
        return cls(guarded_enqueue=client.register_script(PRELUDE + GUARDED_ENQUEUE))
