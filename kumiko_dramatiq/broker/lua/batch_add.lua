-- batch_add: a running child adds a child to its own batch (ctx.batch.add), counted and
-- enqueued in one step (include/batch.lua).
-- KEYS[1] the batch hash "<root>batch:<id>"
-- ARGV[1] kumiko root   ARGV[2] the new child's message id (derived from the adding run's
-- id and how many it added before: a run that runs again adds the same ids)   ARGV[3] its
-- queue   ARGV[4] its redis id   ARGV[5] its encoded message
-- Returns 1 (added), 0 (added before: nothing changes); an error when the batch is not
-- running.
-- @include batch
local key, root, mid = KEYS[1], ARGV[1], ARGV[2]
local head = redis.call("hmget", key, "state", "chain", "ns")
if head[1] ~= "running" then
    return redis.error_reply("kumiko: batch " .. string.sub(key, #root + 7) .. " is "
        .. tostring(head[1] or "gone") .. ", not running: no child can join it")
end
if redis.call("hsetnx", key, "a:" .. mid, "1") == 0 then
    return 0
end
redis.call("rpush", key .. ":children", mid)
redis.call("hincrby", key, "total", 1)
redis.call("hincrby", key, "pending", 1)
if head[2] then
    redis.call("hincrby", batch_key(root, head[2]), "total", 1)
    redis.call("hincrby", batch_key(root, head[2]), "pending", 1)
end
batch_enqueue(head[3], ARGV[3] .. "\t" .. ARGV[4] .. "\t" .. ARGV[5])
return 1
