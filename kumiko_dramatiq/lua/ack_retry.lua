-- ack_retry: ack a failed attempt and enqueue its retry, in one step, so a crash can neither
-- lose the retry nor enqueue it twice.
-- KEYS[1] namespace
-- ARGV[1..6] dispatch head (see _dispatch.lua)
-- ARGV[7] delivered redis message id   ARGV[8] the retry's queue (a delay queue if delayed)
-- ARGV[9] the retry's redis message id   ARGV[10] the encoded retry
-- If the delivered message is no longer this worker's (recovered by maintenance while the
-- worker was presumed dead), nothing happens: it runs again where it was recovered to.
-- Returns 1 (acked and retried) or 0.
-- @include dispatch
-- @include enqueue
if redis.call("srem", queue_acks, ARGV[7]) == 0 then
    return 0
end
redis.call("hdel", queue_messages, ARGV[7])
local retry_list = namespace .. ":" .. ARGV[8]
enqueue_message(retry_list .. ".msgs", retry_list, ARGV[9], ARGV[10])
return 1
