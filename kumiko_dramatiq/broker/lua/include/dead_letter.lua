-- include "dead_letter": move one claimed or popped message to its queue's dead letters.
-- dead_letter(rid) -> 1 if a message moved, 0 if its body was gone.
-- @include counts
-- Needs the names of the dispatch head (queue_messages, dead_letters, dead_bodies, now).
local function dead_letter(rid)
    local body = redis.call("hget", queue_messages, rid)
    if not body then
        return 0
    end
    redis.call("zadd", dead_letters, now, rid)
    redis.call("hset", dead_bodies, rid, body)
    count_body(queue_messages, rid, body, -1)
    count_body(dead_bodies, rid, body, 1)
    redis.call("hdel", queue_messages, rid)
    return 1
end
