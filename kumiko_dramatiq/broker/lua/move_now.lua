-- move_now: a delayed message goes onto its queue now, whatever its due time (run-now).
-- KEYS[1] namespace
-- ARGV[1..] pairs: a queue (not its delay queue) and a redis id the message may have there
--           (ids.redis_id_candidates: kumiko derives a message's redis ids from its id)
-- The first id on its queue's schedule ("<namespace>:<queue>.DQ:schedule",
-- keys.queue_schedule) leaves it, its body leaves the delay queue's hash for the queue's,
-- its id goes to the queue's tail and the queue's doorbell rings: same id, same attempt, as
-- lua/move.lua moves a due one. A few O(log n) steps, never a search. A message still on
-- Dramatiq's own delay queue list (written by an older version, not yet scheduled by
-- lua/schedule_legacy.lua) is not found.
-- Returns {1, queue, redis id} (moved) or {0}.
-- @include bell
-- @include counts
local namespace = KEYS[1]
for i = 1, #ARGV, 2 do
    local queue, rid = ARGV[i], ARGV[i + 1]
    local target = namespace .. ":" .. queue
    local schedule = target .. ".DQ:schedule"
    if redis.call("zrem", schedule, rid) == 1 then
        local body = redis.call("hget", target .. ".DQ.msgs", rid)
        if body then
            count_body(target .. ".DQ.msgs", rid, body, -1)
            redis.call("hdel", target .. ".DQ.msgs", rid)
            redis.call("hset", target .. ".msgs", rid, body)
            count_body(target .. ".msgs", rid, body, 1)
            redis.call("rpush", target, rid)
            ring(target)
            return {1, queue, rid}
        end
    end
end
return {0}
