-- purge_step: one bounded step of removing one job's waiting messages (runner.purge).
-- KEYS[1] namespace
-- ARGV[1] kumiko root "kumiko:<prefix>:"   ARGV[2] the job's qualified name
-- ARGV[3] what to walk: "queued" (a lane queue's list, from its tail), "suspects" (its
-- suspects list, from its tail), "delayed" (its delay queue's message hash, HSCAN), "parked"
-- (the job's parked list, from its head), "capwait" (the job's lists of messages waiting for
-- a cap, include/caps.lua: its own "<root>capwait:<job>", then its per-tenant groups' found
-- by rank in the lane's "<root>capwaiting:<queue>", each from its head) or "dead" (the
-- lane's dead letters, oldest first)
-- ARGV[4] the lane queue   ARGV[5] the cursor (0 to start; what the previous step returned)
-- ARGV[6] how many entries this step reads at most   ARGV[7] now (ms, unused)
-- ARGV[8] unused   ARGV[9] "1": only count, change nothing (kumiko purge --dry-run)
-- Reads at most ARGV[6] entries and their bodies (a body is decoded only when it names the
-- job), so one step costs about 2 ms whatever the queue's size. What it removes:
-- queued: the body is deleted and the redis id noted as withdrawn ("<queue list>:withdrawn",
-- as cancel does: the fetch that meets the id drops it, counts leave it out); one claimed by a
-- worker (running) is left alone. delayed: the id leaves its queue's schedule
-- ("<queue list>.DQ:schedule") and its body is deleted (an id an older version left on
-- Dramatiq's delay queue list is dropped for want of a body when it is scheduled). parked:
-- the id leaves the parked list and its body is deleted. capwait: the id leaves its group's
-- list, its body (and a deliveries count it had) is deleted, the job's waiting count
-- ("<root>capwaits") drops by one, and a group left with no waiter leaves "capwaiting" (the
-- fetch looks only at listed groups; an id cancel withdrew is dropped uncounted). dead: the letter, its body and its note go.
-- A dedup key a removed message held is freed (include/dedup_index.lua). No run record is
-- written. Lists are walked from the tail (queued, suspects), which new messages pushed meanwhile
-- shift but never make it skip an entry; pops from the head only end the walk sooner.
-- Returns {removed, next cursor ("0" when done)}.
-- capwait cursors: "0" or "0j" (the job's own list), then "g<n>" (tenant groups from rank n
-- on). A dry run counts each list's length (a cap's list holds its job's ids only).
-- @include dedup_index
-- @include counts
local namespace, root, job, mode = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local queue, cursor, batch = ARGV[4], ARGV[5], tonumber(ARGV[6])
local dry = ARGV[9] == "1"
local wrapper = job .. ":fanout"
local list = namespace .. ":" .. queue
local removed = 0

-- the decoded message of body if it is one of the job's (its own or its per-tenant wrapper's)
local function of_job(body)
    if not body or not string.find(body, job, 1, true) then
        return nil
    end
    local ok, message = pcall(cjson.decode, body)
    if not ok or type(message) ~= "table" or type(message.options) ~= "table" then
        return nil
    end
    if message.actor_name == job or message.actor_name == wrapper then
        return message
    end
    return nil
end

local function free_dedup(message)
    local key = message.options.kumiko_dedup_key
    if type(key) == "string" then
        local record = root .. "dedup:" .. job .. ":" .. key
        if redis.call("hget", record, "id") == message.message_id then
            redis.call("del", record)
            unindex_dedup(root .. "dedupidx:" .. job, key)
        end
    end
end

-- rids in `entries` whose bodies (in hash `bodies`) are the job's: {rid, message} pairs
local function matching(bodies, rids)
    local found = {}
    if #rids == 0 then
        return found
    end
    local got = redis.call("hmget", bodies, unpack(rids))
    for i, rid in ipairs(rids) do
        local message = of_job(got[i])
        if message then
            found[#found + 1] = {rid, message}
        end
    end
    return found
end

if mode == "queued" or mode == "suspects" then
    local source = list
    if mode == "suspects" then
        source = root .. "suspects:" .. queue
    end
    local offset = tonumber(cursor)
    local length = redis.call("llen", source)
    if offset >= length then
        return {0, "0"}
    end
    local rids = redis.call("lrange", source, -(offset + batch), -(offset + 1))
    for _, pair in ipairs(matching(list .. ".msgs", rids)) do
        local rid, message = pair[1], pair[2]
        if redis.call("hexists", root .. "inflight", rid) == 0 then
            removed = removed + 1
            if not dry then
                uncount(list .. ".msgs", rid)
                redis.call("hdel", list .. ".msgs", rid)
                redis.call("sadd", list .. ":withdrawn", rid)
                free_dedup(message)
            end
        end
    end
    offset = offset + batch
    if offset >= length then
        return {removed, "0"}
    end
    return {removed, tostring(offset)}
elseif mode == "delayed" then
    local bodies = list .. ".DQ.msgs"
    local reply = redis.call("hscan", bodies, cursor, "COUNT", batch)
    local entries = reply[2]
    for i = 1, #entries, 2 do
        local rid, message = entries[i], of_job(entries[i + 1])
        if message then
            removed = removed + 1
            if not dry then
                redis.call("zrem", list .. ".DQ:schedule", rid)
                uncount(bodies, rid)
                redis.call("hdel", bodies, rid)
                free_dedup(message)
            end
        end
    end
    return {removed, reply[1]}
elseif mode == "parked" then
    local parked = root .. "parked:" .. job
    local withdrawn = root .. "parked-withdrawn:" .. job
    if dry then
        local offset = tonumber(cursor)
        local rids = redis.call("lrange", parked, offset, offset + batch - 1)
        for _, pair in ipairs(matching(list .. ".msgs", rids)) do
            if redis.call("sismember", withdrawn, pair[1]) == 0 then
                removed = removed + 1
            end
        end
        if #rids < batch then
            return {removed, "0"}
        end
        return {removed, tostring(offset + batch)}
    end
    local rids = redis.call("lpop", parked, batch)
    if not rids then
        redis.call("del", withdrawn)
        return {0, "0"}
    end
    for _, pair in ipairs(matching(list .. ".msgs", rids)) do
        if redis.call("srem", withdrawn, pair[1]) == 0 then
            removed = removed + 1
        end
        uncount(list .. ".msgs", pair[1])
        redis.call("hdel", list .. ".msgs", pair[1])
        free_dedup(pair[2])
    end
    if #rids < batch then
        redis.call("del", withdrawn)
        return {removed, "0"}
    end
    return {removed, "1"}
elseif mode == "capwait" then
    local waiting = root .. "capwaiting:" .. queue
    local msgs = list .. ".msgs"
    -- take up to `budget` ids off group's list; returns how many were read
    local function take(group, budget)
        local source = root .. "capwait:" .. group
        if dry then
            -- every id waiting is one of the job's (a cap's list holds its job's only)
            local waiters = redis.call("llen", source)
            removed = removed + waiters
            return waiters, true
        end
        local rids = redis.call("lpop", source, budget)
        if not rids then
            redis.call("zrem", waiting, group)
            return 0, true
        end
        local got = redis.call("hmget", msgs, unpack(rids))
        for i, rid in ipairs(rids) do
            local message = of_job(got[i])
            -- every waiter was counted while it waited (as the fetch's serve uncounts it)
            if redis.call("hincrby", root .. "capwaits", job, -1) <= 0 then
                redis.call("hdel", root .. "capwaits", job)
            end
            if got[i] then
                uncount(msgs, rid)
                redis.call("hdel", msgs, rid)
                redis.call("hdel", root .. "inflight", rid)
                if message then
                    removed = removed + 1
                    free_dedup(message)
                end
            else
                -- withdrawn by an older cancel (body gone): forget it
                redis.call("srem", list .. ":withdrawn", rid)
            end
        end
        local emptied = redis.call("llen", source) == 0
        if emptied then
            redis.call("zrem", waiting, group)
        end
        return #rids, emptied
    end
    if cursor == "0" or cursor == "0j" then
        local _, emptied = take(job, batch)
        if not emptied then
            return {removed, "0j"}
        end
        return {removed, "g0"}
    end
    local rank = tonumber(string.sub(cursor, 2)) or 0
    local groups = redis.call("zrange", waiting, rank, rank + 19)
    local budget = batch
    for _, group in ipairs(groups) do
        local owner = string.match(group, "^(.-):tenant:%d+:") or group
        if owner ~= job or group == job or dry then
            rank = rank + 1
            if owner == job and group ~= job then
                budget = budget - take(group, budget)
            end
        else
            local read, emptied = take(group, budget)
            budget = budget - read
            if not emptied then
                return {removed, "g" .. rank}
            end
        end
        if budget <= 0 then
            return {removed, "g" .. rank}
        end
    end
    if #groups < 20 then
        return {removed, "0"}
    end
    return {removed, "g" .. rank}
elseif mode == "dead" then
    local letters = namespace .. ":" .. queue .. ".XQ"
    local offset = tonumber(cursor)
    local rids = redis.call("zrange", letters, offset, offset + batch - 1)
    local kept = #rids
    for _, pair in ipairs(matching(letters .. ".msgs", rids)) do
        removed = removed + 1
        if not dry then
            redis.call("zrem", letters, pair[1])
            uncount(letters .. ".msgs", pair[1])
            redis.call("hdel", letters .. ".msgs", pair[1])
            redis.call("del", root .. "dead:" .. pair[2].message_id)
            kept = kept - 1
        end
    end
    if #rids < batch then
        return {removed, "0"}
    end
    return {removed, tostring(offset + kept)}
end
return redis.error_reply("purge_step: unknown mode " .. tostring(mode))
