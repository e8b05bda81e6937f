-- include "lock_index": the index of held sequential locks, written by the scripts that take,
-- renew and release a lock, so that listing them never walks the keyspace. For a lock
-- "<root>lock:<name>" (root "kumiko:<prefix>:", keys.sequential_lock):
--   <root>locks        sorted set, member <name>, scored by its lease's expiry (ms, Redis's
--                      clock): a reader takes the members scored after now, so a lock whose
--                      holder was killed is not listed once its lease ran out
--   <root>locks:since  hash <name> -> when the lock was taken (ms, Redis's clock)
-- An entry is written with its lease and removed with it; the entries of leases that ran out
-- (their holder died) are removed by the next acquire, at most LOCK_SWEEP of them each time.
-- Both keys live between one and two of the longest lease written into them (their TTL is
-- set to two leases whenever less than one is left: one PTTL per call, a PEXPIRE once per
-- lease), so an index whose locks are all gone expires by itself.

local LOCK_SWEEP = 2

-- clock_ms(): Redis's clock, in ms.
local function lock_clock_ms()
    local now = redis.call("time")
    return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end

-- lock_index_of(lock) -> index, since, name (nil for a key not built by keys.sequential_lock)
local function lock_index_of(lock)
    local root, name = string.match(lock, "^([^:]*:[^:]*:)lock:(.+)$")
    if not root then
        return nil
    end
    return root .. "locks", root .. "locks:since", name
end

-- index_lock(lock, ttl, taken): the lease of lock runs ttl ms from now; taken: it was just
-- taken (its "since" is now, and ran-out entries are swept; a renewed lock was never swept:
-- its key exists)
local function index_lock(lock, ttl, taken)
    local index, since, name = lock_index_of(lock)
    if not index then
        return
    end
    local now = lock_clock_ms()
    redis.call("zadd", index, now + tonumber(ttl), name)
    if taken then
        redis.call("hset", since, name, now)
        if redis.call("pttl", since) < 0 then
            redis.call("pexpire", since, 2 * tonumber(ttl))
        end
        local stale = redis.call("zrangebyscore", index, "-inf", "(" .. now, "LIMIT", 0, LOCK_SWEEP)
        local root = string.sub(index, 1, -6)
        for _, other in ipairs(stale) do
            local left = redis.call("pttl", root .. "lock:" .. other)
            if left < 0 then
                redis.call("zrem", index, other)
                redis.call("hdel", since, other)
            else
                redis.call("zadd", index, now + left, other)
            end
        end
    end
    if redis.call("pttl", index) < tonumber(ttl) then
        redis.call("pexpire", index, 2 * tonumber(ttl))
        redis.call("pexpire", since, 2 * tonumber(ttl))
    end
end

-- unindex_lock(lock): the lock was released
local function unindex_lock(lock)
    local index, since, name = lock_index_of(lock)
    if index then
        redis.call("zrem", index, name)
        redis.call("hdel", since, name)
    end
end
