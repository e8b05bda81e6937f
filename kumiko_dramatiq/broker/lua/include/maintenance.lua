-- include "maintenance": recover a dead worker's unacked messages and expire dead letters,
-- for one queue, in Dramatiq's Redis layout.
-- maintain(namespace, queue, now_ms, heartbeat_timeout_ms, dead_message_ttl_ms)
--   A worker whose heartbeat (<namespace>:__heartbeats__) is older than heartbeat_timeout_ms
--   is dead: each redis message id in its ack set <namespace>:__acks__.<worker>.<queue> whose
--   message still exists goes back to the tail of <namespace>:<queue>, and the ack set is
--   deleted (the queue's doorbell rings if any went back); a dead worker with no ack set left
--   leaves the heartbeats. Dead letters of the
--   queue (<namespace>:<canonical queue>.XQ, ".DQ" stripped) older than dead_message_ttl_ms
--   are deleted.
-- @include bell
-- @include counts
local function maintain(namespace, queue, now, heartbeat_timeout, dead_ttl)
    local heartbeats = namespace .. ":__heartbeats__"
    local list = namespace .. ":" .. queue
    local messages = list .. ".msgs"
    local dead_workers = redis.call("zrangebyscore", heartbeats, 0, now - heartbeat_timeout)
    for _, worker in ipairs(dead_workers) do
        local worker_acks = namespace .. ":__acks__." .. worker
        local acks = worker_acks .. "." .. queue
        for _, rid in ipairs(redis.call("smembers", acks)) do
            if redis.call("hexists", messages, rid) == 1 then
                redis.call("rpush", list, rid)
                ring(list)
            end
        end
        redis.call("del", acks)
        if #redis.call("keys", worker_acks .. ".*") == 0 then
            redis.call("zrem", heartbeats, worker)
        end
    end
    local canonical = queue
    if string.sub(queue, -3) == ".DQ" then
        canonical = string.sub(queue, 1, -4)
    end
    local dead_letters = namespace .. ":" .. canonical .. ".XQ"
    local dead_bodies = dead_letters .. ".msgs"
    for _, rid in ipairs(redis.call("zrangebyscore", dead_letters, 0, now - dead_ttl)) do
        redis.call("zrem", dead_letters, rid)
        uncount(dead_bodies, rid)
        redis.call("hdel", dead_bodies, rid)
    end
end
