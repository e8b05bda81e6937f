-- delete_dead: discard one dead letter (runner.delete_dead).
-- KEYS[1] the dead letters (sorted set <namespace>:<queue>.XQ)   KEYS[2] their bodies
-- KEYS[3] the dead letter's note
-- ARGV[1] the dead letter's redis id
-- Iff it is still a dead letter: it leaves the dead letters, with its body and note.
-- Returns 1, or 0 (gone: retried or deleted already, or expired).
-- @include counts
if redis.call("zrem", KEYS[1], ARGV[1]) == 0 then
    return 0
end
uncount(KEYS[2], ARGV[1])
redis.call("hdel", KEYS[2], ARGV[1])
redis.call("del", KEYS[3])
return 1
