-- ack: Dramatiq's ack: the message was processed; forget it.
-- KEYS[1] namespace
-- ARGV[1..6] dispatch head (see _dispatch.lua)
-- ARGV[7] redis message id
-- Removes the id from this worker's ack set and, if it was there, the message.
-- Returns 1 if the message was this worker's, else 0. Kumiko's lane queues use settle.
-- @include dispatch
local owned = redis.call("srem", queue_acks, ARGV[7])
if owned == 1 then
    redis.call("hdel", queue_messages, ARGV[7])
end
return owned
