-- include "caps": the concurrency caps (max_running) and rate limits of capped jobs, kept at
-- the fetch. Keys (root "kumiko:<prefix>:", keys.cap_*; a group is a job, a job's tenant
-- "<job>:tenant:<bytes>:<tenant>" for a per-tenant rate limit, or a job's fair key
-- "<job>:fair:<digest>" for max_running_per_key, digest "" for the messages without one):
--   <root>slots:<job>      sorted set: owner token "<redis id>#<delivery>" -> lease expiry
--                          (ms, Redis's clock); a run-out lease is reclaimed by whoever looks
--   <root>slots:<job>:fair:<digest>  the same, per fair key (max_running_per_key): a run of
--                          such a job holds its key's slot and, with max_running, the job's,
--                          under one token; its key's slots key is the one the worker holds
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
    -- rate limit's group), kn (max_running_per_key or nil), kjob (its key's group)} or nil:
    -- no caps (or none readable: the worker dead-letters it)
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
        if caps.per_key ~= nil then
            if not caps_int(caps.per_key, 1, 100000) then
                return nil
            end
            local route = message.options.kumiko_route
            local digest = type(route) == "string" and string.match(route, "^%d%.(%x+)$") or ""
            cap.kn, cap.kjob = caps.per_key, actor .. ":fair:" .. digest
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
        if not cap.n and not cap.rc and not cap.kn then
            return nil
        end
        return cap
    end

    -- the job a group belongs to
    local function caps_job_of(group)
        return string.match(group, "^(.-):tenant:%d+:") or string.match(group, "^(.*):fair:%x*$")
            or group
    end

    -- when the earliest lease of job's slots runs out
    local function caps_next_expiry(root, job)
        local first = redis.call("zrange", root .. "slots:" .. job, 0, 0, "WITHSCORES")
        return tonumber(first[2]) or 0
    end

    -- whether one of the n slots of group is free at t (run-out leases reclaimed first)
    local function caps_free(root, group, n, t)
        local key = root .. "slots:" .. group
        redis.call("zremrangebyscore", key, "-inf", t)
        return redis.call("zcard", key) < n
    end

    -- the group of cap whose slots are all taken at t (its job's, then its fair key's) and
    -- when its earliest lease runs out, or nil when a run of cap may take its slots
    local function caps_full(root, cap, t)
        if cap.n and not caps_free(root, cap.job, cap.n, t) then
            return cap.job, caps_next_expiry(root, cap.job)
        end
        if cap.kn and not caps_free(root, cap.kjob, cap.kn, t) then
            return cap.kjob, caps_next_expiry(root, cap.kjob)
        end
        return nil
    end

    -- the slots key a run of cap holds (its fair key's with max_running_per_key: giving it
    -- back gives back the job's too, include/caps_release.lua), or nil: it takes no slot
    local function caps_slot_key(root, cap)
        if cap.kn then
            return root .. "slots:" .. cap.kjob
        elseif cap.n then
            return root .. "slots:" .. cap.job
        end
        return nil
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
        for _, group in ipairs({cap.n and cap.job or false, cap.kn and cap.kjob or false}) do
            if group then
                local key = root .. "slots:" .. group
                redis.call("zadd", key, t + ttl, token)
                -- the set outlives its longest lease (workers with another lock_ttl_ms too)
                if redis.call("pttl", key) < 2 * ttl then
                    redis.call("pexpire", key, 2 * ttl)
                end
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
        if cap.kn and redis.call("exists", root .. "capwait:" .. cap.kjob) == 1 then
            return cap.kjob, nil
        end
        if cap.group ~= cap.job and redis.call("exists", root .. "capwait:" .. cap.group) == 1 then
            return cap.group, nil
        end
        local full, expiry = caps_full(root, cap, t)
        if full then
            return full, expiry
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
        caps_full = caps_full,
        caps_slot_key = caps_slot_key,
        caps_rate_due = caps_rate_due,
        caps_take = caps_take,
        caps_due_by = caps_due_by,
        caps_unwait = caps_unwait,
        caps_park = caps_park,
        caps_blocked = caps_blocked,
    }
    return caps_made
end
