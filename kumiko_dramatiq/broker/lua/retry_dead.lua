-- retry_dead: take a dead letter out of its queue's dead letters and enqueue it again.
-- KEYS[1] the dead letters (sorted set <namespace>:<queue>.XQ)   KEYS[2] their bodies
-- KEYS[3] the queue's message hash   KEYS[4] the queue's list   KEYS[5] the dead letter's note
-- ARGV[1] the dead letter's redis id   ARGV[2] the new redis id   ARGV[3] the new message
-- Iff the dead letter is still there: it leaves the dead letters (body and note too) and the
-- new message is enqueued, in one step. Returns 1, or 0 (gone: retried already, or expired).
-- @include enqueue
if redis.call("zrem", KEYS[1], ARGV[1]) == 0 then
    return 0
end
uncount(KEYS[2], ARGV[1])
redis.call("hdel", KEYS[2], ARGV[1])
redis.call("del", KEYS[5])
enqueue_message(KEYS[3], KEYS[4], ARGV[2], ARGV[3])
return 1
