-- move: due delayed messages go from their queue's schedule onto the queue, a bounded batch
-- in one step (any consumer of the delay queue calls it; whichever comes first moves them).
-- KEYS[1] namespace
-- ARGV[1..2] dispatch head (see include/dispatch.lua), ARGV[1] = the delay queue
-- ARGV[3] at most this many
-- Now is Redis's clock (TIME), so processes on several hosts agree and nothing moves early.
-- Each due id (schedule "<namespace>:<queue>.DQ:schedule", keys.queue_schedule, scored by due
-- time ms), earliest first, leaves the schedule and its body leaves the delay queue's hash
-- for the queue's (it is stored in the form it takes there, see include/enqueue.lua), its id
-- goes to the queue's tail (one with a route: its level's and key's, include/route.lua),
-- and the queue's doorbell rings once. An id without a body (left by a cancel cut short,
-- which cannot happen in one script) is dropped. One script: a kill
-- neither loses a move nor makes it twice.
-- Returns {moved, next due (ms, Redis's clock; -1: none), now (ms, Redis's clock), length of
-- Dramatiq's own delay queue list (messages an older writer left for
-- lua/schedule_legacy.lua)}.
-- @include dispatch
-- @include bell
-- @include route
local time = redis.call("time")
local clock = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local schedule = queue_list .. ":schedule"
local due = redis.call("zrangebyscore", schedule, "-inf", clock, "LIMIT", 0, tonumber(ARGV[3]))
local moved = 0
if #due > 0 then
    local target = namespace .. ":" .. canonical
    local target_messages = target .. ".msgs"
    redis.call("zrem", schedule, unpack(due))
    for _, rid in ipairs(due) do
        local body = redis.call("hget", queue_messages, rid)
        if body then
            count_body(queue_messages, rid, body, -1)
            redis.call("hdel", queue_messages, rid)
            redis.call("hset", target_messages, rid, body)
            count_body(target_messages, rid, body, 1)
            local level, key = route_of(body)
            if level then
                route_push(target, rid, level, key)  -- at its level and key, from its due time
            else
                redis.call("rpush", target, rid)
            end
            moved = moved + 1
        end
    end
    if moved > 0 then
        ring(target)
    end
end
local next_due = -1
local first = redis.call("zrange", schedule, 0, 0, "WITHSCORES")
if first[2] then
    next_due = tonumber(first[2])
end
return {moved, next_due, clock, redis.call("llen", queue_list)}
