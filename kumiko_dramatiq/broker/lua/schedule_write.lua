-- schedule_write: write or remove one runtime schedule (kumiko_dramatiq/schedules), atomically
-- with its place among the due ones, so that no scheduler fires a tick of it the call undid.
-- KEYS[1] the specs hash (keys.schedules)   KEYS[2] the due ones (keys.schedules_due: id ->
-- next tick, ms)   KEYS[3] the last ticks (keys.schedules_last)
-- ARGV[1] the schedule's id   ARGV[2] the spec it had when the caller read it ("" for none)
-- ARGV[3] its new spec ("" to remove it)   ARGV[4] its next tick (ms; "" while paused)
-- Returns {1} (written or removed) or {0, the spec it has now ("" for none)}: another call
-- changed it since it was read (the caller reads again).
local specs, due, last = KEYS[1], KEYS[2], KEYS[3]
local id = ARGV[1]
local now = redis.call("hget", specs, id) or ""
if now ~= ARGV[2] then
    return {0, now}
end
if ARGV[3] == "" then
    redis.call("hdel", specs, id)
    redis.call("zrem", due, id)
    redis.call("hdel", last, id)
    return {1}
end
redis.call("hset", specs, id, ARGV[3])
if ARGV[4] == "" then
    redis.call("zrem", due, id)
else
    redis.call("zadd", due, ARGV[4], id)
end
return {1}
