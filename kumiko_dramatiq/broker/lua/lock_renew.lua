-- lock_renew: extend every lease this process still owns, in one call.
-- KEYS[i] a lock   ARGV[i] the token expected in KEYS[i]   ARGV[#KEYS + 1] lease TTL (ms)
-- Each lock renewed moves its entry in the index of held locks along
-- (include/lock_index.lua).
-- Returns one 1 (renewed) or 0 (lost: expired or taken over) per key.
-- @include lock_index
local ttl = ARGV[#KEYS + 1]
local renewed = {}
for i, key in ipairs(KEYS) do
    if redis.call("get", key) == ARGV[i] then
        redis.call("pexpire", key, ttl)
        index_lock(key, ttl, false)
        renewed[i] = 1
    else
        renewed[i] = 0
    end
end
return renewed
