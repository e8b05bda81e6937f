-- include "guarded": the one "check the guard, then enqueue" step.
-- enqueue_unless_guarded(messages, list, rid, body, guard, guard_value, guard_ttl_ms) -> 1 | 0
-- Enqueues the message and sets its guard unless the guard exists, in one command for the
-- guard (SET NX: checked and set at once). Lua does not roll back, so an error while writing
-- the message (a key of the wrong type) takes the guard away again before the error is
-- raised: it must never be left to silently block the message for good. (Redis refusing
-- writes refuses the script's first write, the guard's, before anything is written.)
-- @include enqueue
-- @include ttl
local function enqueue_unless_guarded(messages, list, rid, body, guard, guard_value, guard_ttl_ms)
    ttl_ms(guard_ttl_ms, "guard")
    if not redis.call("set", guard, guard_value, "PX", guard_ttl_ms, "NX") then
        return 0
    end
    local ok, err = pcall(enqueue_message, messages, list, rid, body)
    if not ok then
        redis.call("del", guard)
        error(err)
    end
    return 1
end
