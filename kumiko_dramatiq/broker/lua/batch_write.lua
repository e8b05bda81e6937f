-- batch_write: write one chunk of a batch's children, staged (not on any queue yet), while
-- the batch is "writing" (include/batch.lua; workflows/batches.py).
-- KEYS[1] the batch hash "<root>batch:<id>"
-- ARGV[1] TTL (ms) of a batch being written: an abandoned write expires, nothing of it ran
-- ARGV[2] how many header fields follow (pairs: name, value; given by the first chunk: the
-- hash is created "writing" with them), then per child: its message id, its queue, its redis
-- id, its encoded message.
-- Refuses (an error) a batch that is no longer "writing". Returns how many children it holds.
-- @include ttl
local key, ttl = KEYS[1], ttl_ms(ARGV[1], "batch write")
local fields = tonumber(ARGV[2])
local state = redis.call("hget", key, "state")
if state == false and fields == 0 then
    return redis.error_reply("kumiko: batch " .. key .. " is not being written (expired?)")
elseif state ~= false and state ~= "writing" then
    return redis.error_reply("kumiko: batch " .. key .. " is " .. state .. ", not writing")
end
if fields > 0 then
    local header = {}
    for i = 3, 2 + 2 * fields do
        header[#header + 1] = ARGV[i]
    end
    redis.call("hset", key, "state", "writing", unpack(header))
end
local children, staged = {}, {}
for i = 3 + 2 * fields, #ARGV, 4 do
    children[#children + 1] = ARGV[i]
    local n = #staged
    staged[n + 1], staged[n + 2], staged[n + 3] = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
end
local held = 0
if #children > 0 then
    held = redis.call("rpush", key .. ":children", unpack(children))
    redis.call("rpush", key .. ":staged", unpack(staged))
else
    held = redis.call("llen", key .. ":children")
end
for _, each in ipairs({key, key .. ":children", key .. ":staged"}) do
    redis.call("pexpire", each, ttl)
end
return held
