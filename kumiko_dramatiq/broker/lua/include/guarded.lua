-- include "guarded": the one "check the guard, then enqueue" step.
-- enqueue_unless_guarded(messages, list, rid, body, guard, guard_value, guard_ttl_ms,
--                        counted) -> 1 | 0   (counted: see count_body in include/counts.lua)
-- Enqueues the message and sets its guard unless the guard exists: one SET NX decides. Lua
-- does not roll back, so if writing the message then fails (a key of the wrong type) the
-- guard is deleted again before the error goes on: it must never silently block the message
-- for good.
-- @include enqueue
-- @include ttl
local function enqueue_unless_guarded(messages, list, rid, body, guard, guard_value, guard_ttl_ms,
                                      counted)
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
