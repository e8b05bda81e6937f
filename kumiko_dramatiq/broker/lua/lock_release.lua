-- lock_release: compare-and-delete of a lease.
-- KEYS[1] the lock   ARGV[1] owner token
-- Deletes the lock (and its entry in the index of held locks, include/lock_index.lua) only
-- if it holds this token. Returns 1 or 0.
-- @include lock_index
if redis.call("get", KEYS[1]) == ARGV[1] then
    unindex_lock(KEYS[1])
    return redis.call("del", KEYS[1])
end
return 0
