-- lock_acquire: take the lease of a sequential job, unless this message handed off already.
-- KEYS[1] the lock   KEYS[2] the hand-off guard of this message id
-- ARGV[1] owner token   ARGV[2] lease TTL (ms)
-- Returns 2 (this message handed off before: a redelivery; do nothing), 1 (acquired: also
-- when we own it already, i.e. our own call re-sent after a dropped connection) or 0 (held).
if redis.call("exists", KEYS[2]) == 1 then
    return 2
end
local owner = redis.call("get", KEYS[1])
if owner == ARGV[1] then
    redis.call("pexpire", KEYS[1], ARGV[2])
    return 1
end
if not owner then
    redis.call("set", KEYS[1], ARGV[1], "PX", ARGV[2])
    return 1
end
return 0
