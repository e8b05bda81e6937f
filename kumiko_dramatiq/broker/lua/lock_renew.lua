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
            -- a fair key's slot (include/caps.lua) holds its job's under the same token
            local job_slots = string.match(key, "^(.*):fair:%x*$")
            for _, each in ipairs({key, job_slots or false}) do
                if each and (each == key or redis.call("zscore", each, ARGV[i])) then
                    redis.call("zadd", each, slot_now + tonumber(ttl), ARGV[i])
                    if redis.call("pttl", each) < 2 * tonumber(ttl) then
                        redis.call("pexpire", each, 2 * tonumber(ttl))
                    end
                end
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
