-- lock_acquire: take the lease of a sequential job.
-- KEYS[1] the lock
-- ARGV[1] owner token   ARGV[2] lease TTL (ms)
-- The lock's entry in the index of held locks follows its lease (include/lock_index.lua).
-- Returns 1 (acquired: also when we own it already, i.e. our own call re-sent after a
-- dropped connection) or 0 (held).
-- @include lock_index
local owner = redis.call("get", KEYS[1])
if owner == ARGV[1] then
    redis.call("pexpire", KEYS[1], ARGV[2])
    index_lock(KEYS[1], ARGV[2], false)
    return 1
end
if not owner then
    redis.call("set", KEYS[1], ARGV[1], "PX", ARGV[2])
    index_lock(KEYS[1], ARGV[2], true)
    return 1
end
return 0
