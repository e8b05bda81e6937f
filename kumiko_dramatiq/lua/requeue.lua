-- requeue: put claimed but unprocessed messages back on their queue (worker shutdown).
-- KEYS[1] namespace   KEYS[2] (optional, kumiko lanes) deliveries hash
-- ARGV[1..6] dispatch head (see _dispatch.lua)
-- ARGV[7..] redis message ids
-- Each id in this worker's ack set whose message exists goes back to the queue's tail; with
-- KEYS[2] its delivery is undone (it never ran), and the count of an id whose message is gone
-- is dropped. Returns how many went back.
-- @include dispatch
local moved = 0
for i = 7, #ARGV do
    if redis.call("srem", queue_acks, ARGV[i]) == 1 then
        if redis.call("hexists", queue_messages, ARGV[i]) == 1 then
            redis.call("rpush", queue_list, ARGV[i])
            moved = moved + 1
            if KEYS[2] and redis.call("hincrby", KEYS[2], ARGV[i], -1) <= 0 then
                redis.call("hdel", KEYS[2], ARGV[i])
            end
        elseif KEYS[2] then
            redis.call("hdel", KEYS[2], ARGV[i])
        end
    end
end
return moved
