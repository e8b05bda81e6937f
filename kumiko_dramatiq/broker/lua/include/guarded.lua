-- include "guarded": the one "check the guard, then enqueue" step.
-- enqueue_unless_guarded(messages, list, rid, body, guard, guard_value, guard_ttl_ms,
--                        counted) -> 1 | 0   (counted: see count_body in include/counts.lua)
-- Enqueues the message and sets its guard unless the guard exists: one SET NX decides. Lua
-- does not roll back, so if writing the message then fails (a key of the wrong type) the
-- guard is deleted again before the error goes on: it must never silently block the message
-- for good.
-- Guard TTL "0": the guard is a "sent" key that is only read, never set here (a new message
-- on a kumiko lane queue, not delayed: KumikoBroker.enqueue; on a delay queue "0" is refused
-- as any TTL below 1 ms: its move to the queue deletes its body, so it keeps its marker).
-- The message is written unless that key exists or its body does (HSETNX): a command re-sent
-- after a dropped connection finds the body of its first write while that copy waits or runs;
-- once it has run, the key its end wrote for the resend window: the "already completed" marker
-- for a completed run (the fetch drops a copy of a completed message id), else a "sent"
-- tombstone (settle.lua: a retry, a sequential hand-off, a dead letter, a plain ack;
-- cancel.lua). So the hot path writes no key of its own; the tombstones are written only where
-- a body ends otherwise. Two ends leave none: a purge (a million tombstones would fill Redis;
-- docs/operations.md), and the fetch's dead letter of a message delivered max_deliveries times
-- (each redelivery follows a worker silent for heartbeat_timeout_ms, a minute by default: the
-- resend window is long past).
-- @include enqueue
-- @include ttl
local function enqueue_unless_guarded(messages, list, rid, body, guard, guard_value, guard_ttl_ms,
                                      counted)
    if guard_ttl_ms == "0" and string.sub(list, -3) ~= ".DQ" then
        if redis.call("exists", guard) == 1 or redis.call("hsetnx", messages, rid, body) == 0 then
            return 0
        end
        push_message(messages, list, rid, body, counted)
        return 1
    end
    ttl_ms(guard_ttl_ms, "guard")
    if not redis.call("set", guard, guard_value, "NX", "PX", guard_ttl_ms) then
        return 0
    end
    local ok, problem = pcall(enqueue_message, messages, list, rid, body, counted)
    if not ok then
        redis.call("del", guard)
        error(problem)
    end
    return 1
end
