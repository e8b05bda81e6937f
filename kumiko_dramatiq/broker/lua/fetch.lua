-- fetch: Dramatiq's fetch: pop up to N messages off a queue and claim them for this worker.
-- KEYS[1] namespace
-- ARGV[1..2] dispatch head (see include/dispatch.lua)
-- ARGV[3] N (at most this many)
-- Returns {rid, body, rid, body, ...}; a body is false when the id had no message
-- (Dramatiq's fetch returns nil there too). Kumiko's lane queues use fetch_lane. A fetch of
-- N messages that leaves more behind rings the queue's doorbell for the next idle consumer.
-- @include dispatch
-- @include bell
local fetched = {}
for _ = 1, tonumber(ARGV[3]) do
    local rid = redis.call("lpop", queue_list)
    if not rid then
        break
    end
    redis.call("sadd", queue_acks, rid)
    fetched[#fetched + 1] = rid
    fetched[#fetched + 1] = redis.call("hget", queue_messages, rid)
end
if #fetched >= 2 * tonumber(ARGV[3]) and redis.call("llen", queue_list) > 0 then
    ring(queue_list)
end
return fetched
