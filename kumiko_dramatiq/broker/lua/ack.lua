-- ack: Dramatiq's ack: the message was processed; forget it.
-- KEYS[1] namespace
-- ARGV[1..2] dispatch head (see include/dispatch.lua)
-- ARGV[3] redis message id
-- Removes the id from this worker's ack set and, if it was there, the message.
-- Returns 1 if the message was this worker's, else 0. Kumiko's lane queues use settle.
-- @include dispatch
local owned = redis.call("srem", queue_acks, ARGV[3])
if owned == 1 then
    uncount(queue_messages, ARGV[3])
    redis.call("hdel", queue_messages, ARGV[3])
end
return owned
