-- nack: move a claimed message to its queue's dead-letter set.
-- KEYS[1] namespace
-- ARGV[1..2] dispatch head (see include/dispatch.lua)
-- ARGV[3] redis message id
-- If the id is in this worker's ack set and its message exists, the message moves to
-- <namespace>:<canonical queue>.XQ (scored by now) and .XQ.msgs. Returns 1 if moved, else 0.
-- @include dispatch
-- @include dead_letter
if redis.call("srem", queue_acks, ARGV[3]) == 0 then
    return 0
end
return dead_letter(ARGV[3])
