-- cancel: make sure a message that has not started never starts.
-- KEYS[1] namespace
-- ARGV[1] kumiko root "kumiko:<prefix>:"   ARGV[2] the message id (or the id a sequential
-- hand-off carries on as its origin)   ARGV[3] now (ms)   ARGV[4] TTL (ms) of completed and
-- cancelled run records   ARGV[5] TTL (ms) of failed ones   ARGV[6] how long past its due
-- time a delayed message held in a worker's memory may still be moved (ms)   ARGV[7] how long
-- the "sent" tombstone of a message taken off a lane queue lives (ms: the resend window)
-- ARGV[8] the request id to ask a worker that holds the message under ("": ask none)
-- ARGV[9..] pairs: a queue (a lane queue or its delay queue) and a redis id the message may
-- have there (ids.redis_id_candidates: kumiko derives a message's redis ids from its id)
-- Looks the message up by those ids only (a few HGETs, never a search of a queue). Not
-- found: {0, "ended"} if the id has a run record or a dead letter note (it completed, died or
-- was cancelled), else {0, "gone"}. Claimed from a lane queue by a worker (in a worker's ack
-- set) and running there (include/inflight.lua): {0, "running"}, nothing changed; held there
-- (claimed ahead of its threads, not started): that worker is asked (include/holds.lua:
-- hold_ask, kind "cancel"), {2, queue, redis id, the worker's broker id, the request id to
-- wait on}: the worker answers whether it dropped it, or, once its hold ran out without an
-- answer, the caller takes it over (lua/hold_takeover.lua). Waiting in a lane queue (its
-- list, its suspects list or a paused job's parked list): its body is deleted and its redis id noted as withdrawn (in
-- "<queue list>:withdrawn", or "<root>parked-withdrawn:<job>" while its job is paused), so
-- the fetch or resume that meets the id drops it and counts leave it out: no search of the
-- list. Waiting for a cap (include/caps.lua: in "<root>capwait:<job>" or a per-tenant
-- group's list, off the queue list): it leaves that list (LREM, O(waiters): about 3 ms at
-- 100,000 waiting), its job's waiting count ("<root>capwaits") drops by one, a group left
-- with no waiter leaves "<root>capwaiting:<queue>", and its body is deleted; nothing is noted
-- as withdrawn. Delayed, on its queue's schedule ("<delay queue list>:schedule", keys.queue_schedule):
-- it leaves the schedule and its body is deleted (O(log n); counts drop at once). Written by
-- an older version, on Dramatiq's own delay queue list: its body is deleted (the step that
-- schedules it, or the old worker that fetches the id, finds nothing to run). Held in an old
-- worker's memory, waiting to come due: the cancel marker "<root>cancel:<message id>" is set
-- until it is due plus ARGV[6], and its move drops it (a second cancel then finds the
-- marker: {0, "ended"}).
-- A message taken off a lane queue leaves its "sent" tombstone "<root>sent:<redis id>" for
-- ARGV[7] ms, so a re-sent enqueue of its first write does not bring it back (see
-- include/guarded.lua). Either way its run record says "cancelled" and a dedup key it held
-- is freed (and leaves its job's index, include/dedup_index.lua).
-- Returns {1, queue, redis id} (cancelled), {2, ...} (asked, above) or {0, reason}.
-- @include holds
-- @include ttl
-- @include route
local namespace, root, wanted = KEYS[1], ARGV[1], ARGV[2]
local now = tonumber(ARGV[3])

-- whether rid (a message of job with options, on lane queue) waited for a cap: then it is
-- off its group's list and uncounted there
local function unwait(queue, job, options, rid)
    if type(options.kumiko_caps) ~= "table" then
        return false
    end
    local groups = {job}
    local tenant = options.kumiko_tenant_id
    if type(tenant) == "string" then
        groups[#groups + 1] = job .. ":tenant:" .. #tenant .. ":" .. tenant
    end
    if options.kumiko_caps.per_key ~= nil then -- its fair key's group (include/caps.lua)
        local route = options.kumiko_route
        local digest = type(route) == "string" and string.match(route, "^%d%.(%x+)$") or ""
        groups[#groups + 1] = job .. ":fair:" .. digest
    end
    for _, group in ipairs(groups) do
        local list = root .. "capwait:" .. group
        if redis.call("lrem", list, 1, rid) == 1 then
            if redis.call("hincrby", root .. "capwaits", job, -1) <= 0 then
                redis.call("hdel", root .. "capwaits", job)
            end
            if redis.call("exists", list) == 0 then
                redis.call("zrem", root .. "capwaiting:" .. queue, group)
            end
            return true
        end
    end
    return false
end

-- the decoded message of body if it is the one wanted (or a hand-off carrying it on)
local function wanted_in(body)
    local message = decode_message(body)
    if not message then
        return nil
    end
    if message.message_id == wanted then
        return message
    end
    local options = message.options
    if options.kumiko_origin_id == wanted and options.kumiko_trigger == "requeue" then
        return message
    end
    return nil
end

ttl_ms(ARGV[7], "sent tombstone")
local request = ARGV[8]
for i = 9, #ARGV, 2 do
    local queue, rid = ARGV[i], ARGV[i + 1]
    local list = namespace .. ":" .. queue
    local body = redis.call("hget", list .. ".msgs", rid)
    local message = wanted_in(body)
    if message then
        local delayed = string.sub(queue, -3) == ".DQ"
        local job = job_of(type(message.actor_name) == "string" and message.actor_name or "")
        local holder = nil
        if delayed and redis.call("zrem", list .. ":schedule", rid) == 1 then
            -- on its queue's schedule: off it, with its body
            forget_body(list .. ".msgs", rid)
        else
            holder = holder_of(namespace, queue, rid)
            if holder and not delayed then
                if request ~= "" and inflight_held(redis.call("hget", root .. "inflight", rid))
                then
                    return {2, queue, rid, holder, hold_ask(root, holder, rid, request, "cancel")}
                end
                return {0, "running"}
            elseif holder then
                -- held in an old worker's memory until due: its move drops it
                if redis.call("exists", root .. "cancel:" .. message.message_id) == 1 then
                    return {0, "ended"}
                end
                local due = tonumber(message.options.eta) or now
                local ttl = math.max(due - now, 0) + tonumber(ARGV[6])
                redis.call("set", root .. "cancel:" .. message.message_id, "1", "PX", ttl)
            else
                forget_body(list .. ".msgs", rid)
                if not delayed then
                    redis.call("set", root .. "sent:" .. rid, "1", "PX", ARGV[7])
                    redis.call("hdel", root .. "inflight", rid)
                    if message.actor_name == job and unwait(queue, job, message.options, rid) then
                        -- it waited for a cap: off that list already
                    elseif redis.call("sismember", root .. "paused", job) == 1 then
                        redis.call("sadd", root .. "parked-withdrawn:" .. job, rid)
                    else
                        redis.call("sadd", list .. ":withdrawn", rid)
                        route_withdrawn(list, body, 1)
                    end
                end
            end
        end
        record_cancelled(root, body, now, tonumber(ARGV[4]), tonumber(ARGV[5]))
        free_dedup(root, job, message)
        return {1, queue, rid}
    end
end
if redis.call("exists", root .. "run:" .. wanted, root .. "dead:" .. wanted) > 0 then
    return {0, "ended"}
end
return {0, "gone"}
