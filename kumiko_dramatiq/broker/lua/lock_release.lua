-- lock_release: compare-and-delete of a lease.
-- KEYS[1] the lock   ARGV[1] owner token
-- Deletes the lock only if it holds this token. Returns 1 or 0.
if redis.call("get", KEYS[1]) == ARGV[1] then
    return redis.call("del", KEYS[1])
end
return 0
