-- lock_renew: extend every lease this process still owns, in one call.
-- KEYS[i] a lock, or a capped job's slots (include/caps.lua)   ARGV[i] the token expected
-- in KEYS[i] (a slot: its member, whose lease must not have run out)   ARGV[#KEYS + 1]
-- lease TTL (ms)
-- Each lock renewed moves its entry in the index of held locks along
-- (include/lock_index.lua).
-- Returns one 1 (renewed) or 0 (lost: expired or taken over) per key.
-- @include lock_index
local ttl = ARGV[#KEYS + 1]
local renewed = {}
local slot_now = nil
for i, key in ipairs(KEYS) do
    if string.match(key, "^[^:]*:[^:]*:slots:") then
        slot_now = slot_now or lock_clock_ms()
        local expiry = redis.call("zscore", key, ARGV[i])
        if expiry and tonumber(expiry) > slot_now then
            redis.call("zadd", key, slot_now + tonumber(ttl), ARGV[i])
            if redis.call("pttl", key) < 2 * tonumber(ttl) then
                redis.call("pexpire", key, 2 * tonumber(ttl))
            end
            renewed[i] = 1
        else
            renewed[i] = 0
        end
    elseif redis.call("get", key) == ARGV[i] then
        redis.call("pexpire", key, ttl)
        index_lock(key, ttl, false)
        renewed[i] = 1
    else
        renewed[i] = 0
    end
end
return renewed
