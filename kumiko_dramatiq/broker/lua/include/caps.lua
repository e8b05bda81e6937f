-- include "caps": the concurrency caps (max_running) and rate limits of capped jobs, kept at
-- the fetch. Keys (root "kumiko:<prefix>:", keys.cap_*; a group is a job, or a job's tenant
-- "<job>:tenant:<bytes>:<tenant>" for a per-tenant rate limit):
--   <root>slots:<job>      sorted set: owner token "<redis id>#<delivery>" -> lease expiry
--                          (ms, Redis's clock); a run-out lease is reclaimed by whoever looks
--   <root>rate:<group>     sorted set: owner token -> when it started (ms): the starts in the
--                          rate limit's window (a sliding window: at most count in any per_ms)
--   <root>capwait:<group>  list: redis ids waiting for the group's caps, oldest first (their
--                          bodies stay in the queue's hash; not claimed, no attempt spent)
--   <root>capwaiting:<queue>  sorted set, per lane queue: group -> when the fetch should
--                          look at it next (the earliest lease expiry, the rate window's next
--                          opening, or 0 once a slot was given back)
--   <root>capwaits         hash: job -> messages waiting (every group of it)
-- A message carries its job's caps in its options (kumiko_caps, codec.py); a per-tenant
-- wrapper (actor "<job>:fanout") takes none. Times come from Redis's clock (TIME). Every
-- script that includes this piece has the lane queue's name as ARGV[1] (the broker commands'
-- convention, include/dispatch.lua).
-- @include caps_release
-- @include body

-- caps_module(): a table of the functions below. A script defines its functions anew on every
-- call, so only a fetch of a lane with capped jobs makes them: any other fetch pays for this
-- one function alone. They use nothing of a call but their arguments, so once made they are
-- kept: in the hot path's function library (lua/__init__.py) for as long as it is loaded.
local caps_made = nil
local function caps_module()
    if caps_made then
        return caps_made
    end
    local function caps_clock_ms()
        local now_time = redis.call("time")
        return tonumber(now_time[1]) * 1000 + math.floor(tonumber(now_time[2]) / 1000)
    end

    -- whether value is an integer from low to high (codec.py's bounds: a forged value outside
    -- them takes no cap here, and the worker dead-letters its message)
    local function caps_int(value, low, high)
        return type(value) == "number" and value >= low and value <= high and value % 1 == 0
    end

    -- caps_of(body) -> {job, n (max_running or nil), rc, rms (rate limit or nil), group (the
    -- rate limit's group)} or nil: no caps (or none readable: the worker dead-letters it)
    local function caps_of(body)
        if not body or not string.find(body, '"kumiko_caps"', 1, true) then
            return nil
        end
        local message = decode_message(body)
        if not message then
            return nil
        end
        local caps, actor = message.options.kumiko_caps, message.actor_name
        if type(caps) ~= "table" or type(actor) ~= "string"
            or string.sub(actor, -7) == ":fanout" then
            return nil
        end
        local cap = {job = actor, group = actor}
        if caps.max_running ~= nil then
            if not caps_int(caps.max_running, 1, 100000) then
                return nil
            end
            cap.n = caps.max_running
        end
        local rate = caps.rate_limit
        if rate ~= nil then
            if type(rate) ~= "table" or #rate ~= 3 or not caps_int(rate[1], 1, 100000)
                or not caps_int(rate[2], 1, 31622400000) or type(rate[3]) ~= "boolean" then
                return nil
            end
            cap.rc, cap.rms = rate[1], rate[2]
            local tenant = message.options.kumiko_tenant_id
            if rate[3] == true and type(tenant) == "string" then
                cap.group = actor .. ":tenant:" .. #tenant .. ":" .. tenant
            end
        end
        if not cap.n and not cap.rc then
            return nil
        end
        return cap
    end

    -- the job a group belongs to
    local function caps_job_of(group)
        return string.match(group, "^(.-):tenant:%d+:") or group
    end

    -- when the earliest lease of job's slots runs out
    local function caps_next_expiry(root, job)
        local first = redis.call("zrange", root .. "slots:" .. job, 0, 0, "WITHSCORES")
        return tonumber(first[2]) or 0
    end

    -- whether a slot of cap's job is free at t (run-out leases reclaimed first)
    local function caps_slot_free(root, cap, t)
        if not cap.n then
            return true
        end
        local key = root .. "slots:" .. cap.job
        redis.call("zremrangebyscore", key, "-inf", t)
        return redis.call("zcard", key) < cap.n
    end

    -- 0 if cap's rate limit lets a run start at t, else when it will
    local function caps_rate_due(root, cap, t)
        if not cap.rc then
            return 0
        end
        local key = root .. "rate:" .. cap.group
        redis.call("zremrangebyscore", key, "-inf", t - cap.rms)
        if redis.call("zcard", key) < cap.rc then
            return 0
        end
        local oldest = redis.call("zrange", key, 0, 0, "WITHSCORES")
        return tonumber(oldest[2]) + cap.rms
    end

    -- a run of cap starts at t under token: take a slot (a lease of ttl ms) and count the start
    local function caps_take(root, cap, token, t, ttl)
        if cap.n then
            local key = root .. "slots:" .. cap.job
            redis.call("zadd", key, t + ttl, token)
            -- the set outlives its longest lease (workers with another lock_ttl_ms included)
            if redis.call("pttl", key) < 2 * ttl then
                redis.call("pexpire", key, 2 * ttl)
            end
        end
        if cap.rc then
            local key = root .. "rate:" .. cap.group
            redis.call("zadd", key, t, token)
            redis.call("pexpire", key, cap.rms + 1000)
        end
    end

    -- look at group by check_at at the latest (nil: keep its time, or now if it has none)
    -- (returns whether that made it due sooner)
    local function caps_due_by(root, group, check_at)
        local waiting = caps_waiting(root)
        local score = redis.call("zscore", waiting, group)
        if not score or (check_at and tonumber(score) > check_at) then
            redis.call("zadd", waiting, check_at or 0, group)
            return true
        end
        return false
    end

    -- one message of group's job no longer waits (the count's field goes at 0)
    local function caps_unwait(root, group)
        local job = caps_job_of(group)
        if redis.call("hincrby", root .. "capwaits", job, -1) <= 0 then
            redis.call("hdel", root .. "capwaits", job)
        end
    end

    -- rid waits at the end of group's list, looked at by check_at at the latest
    -- (returns whether that made the group due sooner)
    local function caps_park(root, group, rid, check_at)
        redis.call("rpush", root .. "capwait:" .. group, rid)
        redis.call("hincrby", root .. "capwaits", caps_job_of(group), 1)
        return caps_due_by(root, group, check_at)
    end

    -- where a message of cap that is not waiting yet must wait, or nil (it may start at t):
    -- behind others already waiting (arrival order), for a slot, or for the rate window (then
    -- also its due time and true)
    local function caps_blocked(root, cap, t)
        if redis.call("exists", root .. "capwait:" .. cap.job) == 1 then
            return cap.job, nil
        end
        if cap.group ~= cap.job and redis.call("exists", root .. "capwait:" .. cap.group) == 1 then
            return cap.group, nil
        end
        if not caps_slot_free(root, cap, t) then
            return cap.job, caps_next_expiry(root, cap.job)
        end
        local due = caps_rate_due(root, cap, t)
        if due > 0 then
            return cap.group, due, true
        end
        return nil
    end

    caps_made = {
        caps_clock_ms = caps_clock_ms,
        caps_int = caps_int,
        caps_of = caps_of,
        caps_job_of = caps_job_of,
        caps_next_expiry = caps_next_expiry,
        caps_slot_free = caps_slot_free,
        caps_rate_due = caps_rate_due,
        caps_take = caps_take,
        caps_due_by = caps_due_by,
        caps_unwait = caps_unwait,
        caps_park = caps_park,
        caps_blocked = caps_blocked,
    }
    return caps_made
end
