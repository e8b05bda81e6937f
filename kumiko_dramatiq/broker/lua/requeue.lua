-- requeue: put claimed but unprocessed messages back on their queue (worker shutdown).
-- KEYS[1] namespace   KEYS[2] (optional, kumiko lanes) in-flight hash (see fetch_lane)
-- ARGV[1..2] dispatch head (see include/dispatch.lua)
-- ARGV[3..] redis message ids
-- Each id in this worker's ack set whose message exists goes back to the queue's tail; with
-- KEYS[2] its delivery is undone (it never ran: its deliveries count goes one down, its entry
-- goes at 0; include/inflight.lua), and the entry of an id whose message is gone is dropped.
-- The queue's doorbell rings if any went back. Returns how many went back.
-- @include dispatch
-- @include inflight
local moved = 0
for i = 3, #ARGV do
    if redis.call("srem", queue_acks, ARGV[i]) == 1 then
        if redis.call("hexists", queue_messages, ARGV[i]) == 1 then
            redis.call("rpush", queue_list, ARGV[i])
            moved = moved + 1
            if KEYS[2] then
                local entry = inflight_requeued(redis.call("hget", KEYS[2], ARGV[i]))
                if entry then
                    redis.call("hset", KEYS[2], ARGV[i], entry)
                else
                    redis.call("hdel", KEYS[2], ARGV[i])
                end
            end
        elseif KEYS[2] then
            redis.call("hdel", KEYS[2], ARGV[i])
        end
    end
end
if moved > 0 then
    ring(queue_list)
end
return moved
