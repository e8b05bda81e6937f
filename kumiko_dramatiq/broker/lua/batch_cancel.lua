-- batch_cancel: cancel a batch or chain (runner.cancel_batch; include/batch.lua).
-- KEYS[1] the batch hash "<root>batch:<id>"
-- ARGV[1] kumiko root   ARGV[2] the batch id   ARGV[3] now (ms)
-- Marks it cancelled (it ends "cancelled": on_complete runs, on_success never does; a chain
-- opens no further step) and drops the children still staged (each ends "cancelled" now).
-- Returns {dropped, children of later steps that will never start, the ids of the children
-- that have not ended (the caller cancels those not started)}, or {-1} for no such batch.
-- @include batch
local key, root, id, now = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local head = redis.call("hmget", key, "kind", "state", "step", "steps")
if not head[1] or head[2] == "writing" then
    return {-1}
end
if head[2] ~= "running" then
    return {0, 0, {}}
end
redis.call("hset", key, "cancel", "1")
local target, later = id, 0
if head[1] == "chain" then
    target = id .. "." .. head[3]
    redis.call("hset", batch_key(root, target), "cancel", "1")
    for step = tonumber(head[3]) + 1, tonumber(head[4]) do
        later = later + redis.call("llen", batch_key(root, id .. "." .. step) .. ":children")
    end
end
local target_key = batch_key(root, target)
local staged = redis.call("lrange", target_key .. ":staged", 0, -1)
redis.call("del", target_key .. ":staged")
for i = 3, #staged, 3 do
    local body = staged[i]
    local mid = message_id_of(body)
    if mid then
        batch_child_ended(root, target, mid, "cancelled",
            batch_head("cancelled", job_of(actor_of(body) or "")), nil, now)
    end
end
local open = {}
local children = redis.call("lrange", target_key .. ":children", 0, -1)
for start = 1, #children, 1000 do
    local ids = {}
    for i = start, math.min(start + 999, #children) do
        ids[#ids + 1] = children[i]
    end
    local ended = redis.call("hmget", target_key .. ":ended", unpack(ids))
    for i, mid in ipairs(ids) do
        if not ended[i] then
            open[#open + 1] = mid
        end
    end
end
return {#staged / 3, later, open}
