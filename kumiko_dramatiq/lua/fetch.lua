-- fetch: pop up to N messages off a queue and claim them for this worker (its ack set).
-- KEYS[1] namespace
-- ARGV[1..6] dispatch head (see _dispatch.lua)
-- ARGV[7] N (at most this many)
-- ARGV[8] "already completed" marker prefix, or "" not to check: a message whose
--         "<prefix><message id>" key exists is acked here and not returned
-- Returns {{rid, body, rid, body, ...}, {message ids acked as already completed}}.
-- A body is false when the id had no message (Dramatiq returns nil there too).
-- @include dispatch
local wanted = tonumber(ARGV[7])
local done_prefix = ARGV[8]
local fetched = {}
local dropped = {}
for _ = 1, wanted do
    local rid = redis.call("lpop", queue_list)
    if not rid then
        break
    end
    redis.call("sadd", queue_acks, rid)
    local body = redis.call("hget", queue_messages, rid)
    local done = false
    if body and done_prefix ~= "" then
        local ok, message = pcall(cjson.decode, body)
        if ok and type(message) == "table" and type(message.message_id) == "string"
            and redis.call("exists", done_prefix .. message.message_id) == 1 then
            redis.call("srem", queue_acks, rid)
            redis.call("hdel", queue_messages, rid)
            dropped[#dropped + 1] = message.message_id
            done = true
        end
    end
    if not done then
        fetched[#fetched + 1] = rid
        fetched[#fetched + 1] = body
    end
end
return {fetched, dropped}
