-- move: a due delayed message goes from its delay queue to its queue, in one step.
-- KEYS[1] namespace   KEYS[2] the cancel marker of its message id
-- ARGV[1..2] dispatch head (see include/dispatch.lua), ARGV[1] = the delay queue
-- ARGV[3] its redis id on the delay queue   ARGV[4] the queue it moves to
-- ARGV[5] its new redis id   ARGV[6] the message as it goes there (no eta)
-- Iff the id is in this worker's ack set of the delay queue: it leaves the delay queue and,
-- unless its message id was cancelled meanwhile (KEYS[2] exists; deleted here), is written
-- to its queue. So a kill can neither lose the move nor make it twice (Dramatiq moves by an
-- enqueue and then an ack: a kill between them left a second copy).
-- Returns 1 (moved), 2 (cancelled: dropped) or 0 (no longer this worker's: recovered by
-- maintenance, its new holder moves it).
-- @include dispatch
-- @include enqueue
if redis.call("srem", queue_acks, ARGV[3]) == 0 then
    return 0
end
uncount(queue_messages, ARGV[3])
redis.call("hdel", queue_messages, ARGV[3])
if redis.call("del", KEYS[2]) == 1 then
    return 2
end
local target = namespace .. ":" .. ARGV[4]
enqueue_message(target .. ".msgs", target, ARGV[5], ARGV[6])
return 1
