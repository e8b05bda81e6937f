-- include "dedup_index": the index of one job's live dedup records, written by every script
-- that writes or deletes a record, so that listing them never walks the keyspace:
--   <root>dedupidx:<job>   sorted set, member the dedup key, scored by its record's expiry
--                          (ms, Redis's clock; keys.dedup_index)
-- A reader takes the members scored after now, so a record that expired (its message was lost
-- for good) is never listed; each new record removes up to DEDUP_SWEEP entries that ran out
-- (of records that are gone: one still there is scored again by its TTL).
-- The index lives between one and two of the longest record TTL written into it (its TTL is
-- set to two whenever less than one is left: one PTTL per call, a PEXPIRE now and then).

local DEDUP_SWEEP = 2

local function dedup_clock_ms()
    local now = redis.call("time")
    return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end

-- index_dedup(index, key, ttl, fresh): the record of key expires ttl ms from now; fresh: a new
-- record (entries that ran out are swept)
local function index_dedup(index, key, ttl, fresh)
    local now = dedup_clock_ms()
    redis.call("zadd", index, now + tonumber(ttl), key)
    if fresh then
        local stale = redis.call("zrangebyscore", index, "-inf", "(" .. now, "LIMIT", 0,
            DEDUP_SWEEP)
        local head, job = string.match(index, "^(.-)dedupidx:(.*)$")
        for _, other in ipairs(stale) do
            local left = redis.call("pttl", head .. "dedup:" .. job .. ":" .. other)
            if left < 0 then
                redis.call("zrem", index, other)
            else
                redis.call("zadd", index, now + left, other)
            end
        end
    end
    if redis.call("pttl", index) < tonumber(ttl) then
        redis.call("pexpire", index, 2 * tonumber(ttl))
    end
end

-- unindex_dedup(index, key): the record of key was deleted
local function unindex_dedup(index, key)
    redis.call("zrem", index, key)
end
