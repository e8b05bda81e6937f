-- run_now: a delayed message goes onto its queue now, whatever its due time (runner.run_now).
-- KEYS[1] namespace   KEYS[2] the cancel marker of its message id
-- ARGV[1] the delay queue ("<queue>.DQ")   ARGV[2] its redis id there   ARGV[3] its body there,
-- as the caller read it   ARGV[4] the queue   ARGV[5] its redis id on the queue
-- ARGV[6] the message as it goes there (no eta)   ARGV[7] how long the cancel marker lives (ms)
-- Iff the body is still the one read (and not cancelled): it leaves the delay queue (its body
-- is deleted; a worker holding it in memory until due finds the cancel marker and drops it at
-- its move) and the message is written to its queue, same message id and attempt, in one
-- step. Returns 1 (queued now) or 0 (no longer delayed: moved, cancelled or gone).
-- @include enqueue
local namespace = KEYS[1]
local delayed = namespace .. ":" .. ARGV[1]
if redis.call("hget", delayed .. ".msgs", ARGV[2]) ~= ARGV[3] then
    return 0
end
if redis.call("exists", KEYS[2]) == 1 then
    return 0
end
local claimed = false
for _, worker in ipairs(redis.call("zrange", namespace .. ":__heartbeats__", 0, -1)) do
    if redis.call("sismember", namespace .. ":__acks__." .. worker .. "." .. ARGV[1], ARGV[2])
        == 1 then
        claimed = true
    end
end
uncount(delayed .. ".msgs", ARGV[2])
redis.call("hdel", delayed .. ".msgs", ARGV[2])
if claimed then
    redis.call("set", KEYS[2], "1", "PX", tonumber(ARGV[7]))
end
local target = namespace .. ":" .. ARGV[4]
enqueue_message(target .. ".msgs", target, ARGV[5], ARGV[6])
return 1
