-- include "guarded": the one "check the guard, then enqueue" step.
-- enqueue_unless_guarded(messages, list, rid, body, guard, guard_value, guard_ttl_ms) -> 1 | 0
-- Enqueues the message and sets its guard unless the guard exists. The message is written
-- BEFORE its guard: Lua does not roll back, so an error while writing the message (a key of
-- the wrong type) must never leave a guard that silently blocks the message for good.
-- @include enqueue
-- @include ttl
local function enqueue_unless_guarded(messages, list, rid, body, guard, guard_value, guard_ttl_ms)
    ttl_ms(guard_ttl_ms, "guard")
    if redis.call("exists", guard) == 1 then
        return 0
    end
    enqueue_message(messages, list, rid, body)
    redis.call("set", guard, guard_value, "PX", guard_ttl_ms)
    return 1
end
