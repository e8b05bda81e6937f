-- batch_dispatch: a whole batch of at most a chunk of children in one step: its record, open,
-- and every child on its queue (include/batch.lua; the larger ones are written staged first:
-- batch_write, batch_commit). One call is all or none by itself.
-- KEYS[1] the batch hash "<root>batch:<id>"   KEYS[2] (with an idempotency key) the key's
-- record "<root>idem:batch:<key>" (the first dispatch's batch id)
-- ARGV[1] kumiko root   ARGV[2] the batch id   ARGV[3] now (ms)   ARGV[4] the record's TTL
-- (ms; "0" without a key)
-- ARGV[5] how many header fields follow (pairs: name, value), then per child: its message id,
-- its queue, its redis id, its encoded message.
-- Returns 1, 0 when the batch exists already (a call re-sent after a dropped connection:
-- nothing is written twice), or the first dispatch's batch id when the key's record holds
-- one (nothing written).
-- @include batch
local key, root, id, now = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local record = KEYS[2]
if record then
    local first = redis.call("get", record)
    if first then
        return first
    end
end
if redis.call("exists", key) == 1 then
    return 0
end
local fields = tonumber(ARGV[5])
local header = {}
for i = 6, 5 + 2 * fields do
    header[#header + 1] = ARGV[i]
end
local children, ns = {}, nil
for i = 1, #header, 2 do
    if header[i] == "ns" then
        ns = header[i + 1]
    end
end
for i = 6 + 2 * fields, #ARGV, 4 do
    children[#children + 1] = ARGV[i]
end
redis.call("hset", key, "state", "running", "total", #children, "pending", #children,
    "completed", 0, "dead", 0, "cancelled", 0, "started", now, unpack(header))
redis.call("rpush", key .. ":children", unpack(children))
for i = 6 + 2 * fields, #ARGV, 4 do
    local list = ns .. ":" .. ARGV[i + 1]
    enqueue_message(list .. ".msgs", list, ARGV[i + 2], ARGV[i + 3])
end
redis.call("zadd", root .. "batches", now, id)
if record then
    redis.call("set", record, id, "PX", ARGV[4])
end
return 1
