-- ack: the message was processed; forget it.
-- KEYS[1] namespace   KEYS[2] (optional) "already completed" marker of its message id
-- ARGV[1..6] dispatch head (see _dispatch.lua)
-- ARGV[7] redis message id   ARGV[8] (with KEYS[2]) marker TTL (ms)
-- Removes the id from this worker's ack set and, if it was there, the message; with KEYS[2]
-- sets the marker either way. Returns 1 if the message was this worker's, else 0.
-- @include dispatch
local owned = redis.call("srem", queue_acks, ARGV[7])
if owned == 1 then
    redis.call("hdel", queue_messages, ARGV[7])
end
if KEYS[2] then
    redis.call("set", KEYS[2], "1", "PX", ARGV[8])
end
return owned
