-- purge_step: one bounded step of removing one job's waiting messages (runner.purge).
-- KEYS[1] namespace
-- ARGV[1] kumiko root "kumiko:<prefix>:"   ARGV[2] the job's qualified name
-- ARGV[3] what to walk: "queued" (a lane queue's list, from its tail), "order" (the lists of
-- its order, include/route.lua: by level, by rank in the level's ring, each from its tail),
-- "suspects" (its suspects list, from its tail), "delayed" (its delay queue's message hash,
-- HSCAN), "parked" (the job's parked list, from its head), "capwait" (the job's lists of
-- messages waiting for a cap, include/caps.lua: its own "<root>capwait:<job>", then its
-- per-tenant and per-key groups' found by rank in the lane's "<root>capwaiting:<queue>",
-- each from its head) or "dead" (the lane's dead letters, oldest first)
-- ARGV[4] the lane queue   ARGV[5] the cursor (0 to start; what the previous step returned)
-- ARGV[6] how many entries this step reads at most (for "delayed": HSCAN's COUNT)
-- ARGV[7] now (ms: the end of a batch child it removes)
-- ARGV[8] how many bytes of bodies this step reads at most
-- ARGV[9] "1": only count, change nothing (kumiko purge --dry-run)
-- A step is bounded twice: it reads at most ARGV[6] entries, and once the bodies it read
-- reach ARGV[8] bytes it reads no more (one body at a time, HGET, so it reads at most one body
-- beyond; the first entry of a step is always read, so every step moves on), the next step
-- starting at the entry it did not read. So a step costs about the same whatever the queue's
-- size and whatever its messages' sizes (a body is decoded only when it names the job).
-- "delayed" walks with HSCAN, which hands over the bodies of the entries it visits: there
-- ARGV[6] is the COUNT, which the caller sizes from the bodies the previous step read.
-- What it removes:
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
-- Returns {removed, next cursor ("0" when done), bytes of bodies read, entries read}.
-- capwait cursors: "0" or "0j" (the job's own list), then "g<n>" (tenant groups from rank n
-- on); a dry run counts each list's length (a cap's list holds its job's ids only). dead
-- cursors: "0", then "d<offset>".
-- @include cancelling
-- @include batch
-- @include route
local namespace, root, job, mode = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local queue, cursor, batch = ARGV[4], ARGV[5], tonumber(ARGV[6])
local byte_budget = tonumber(ARGV[8])
local dry = ARGV[9] == "1"
local wrapper = job .. ":fanout"
local list = namespace .. ":" .. queue
local removed = 0
local spent, read = 0, 0 -- bytes of bodies and entries this step read

-- the first of `rids` (in the order they are walked) this step reads, and their bodies (in
-- hash `bodies`; false: none): one by one until the bodies read reach the byte budget, the
-- step's first entry in any case
local function read_bodies(bodies, rids)
    local taken, got = {}, {}
    for _, rid in ipairs(rids) do
        if read > 0 and spent >= byte_budget then
            break
        end
        local body = redis.call("hget", bodies, rid)
        read = read + 1
        taken[#taken + 1] = rid
        got[#taken] = body
        if body then
            spent = spent + #body
        end
    end
    return taken, got
end

-- the decoded message of body if it is one of the job's (its own or its per-tenant wrapper's)
local function of_job(body)
    if not body or not string.find(body, job, 1, true) then
        return nil
    end
    local message = decode_message(body)
    if message and (message.actor_name == job or message.actor_name == wrapper) then
        return message
    end
    return nil
end

-- the entries of `rids` whose bodies (`got`, by position) are the job's: {rid, message, body}
local function matching(rids, got)
    local found = {}
    for i, rid in ipairs(rids) do
        local message = of_job(got[i])
        if message then
            found[#found + 1] = {rid, message, got[i]}
        end
    end
    return found
end

-- remove the job's messages among the last `batch` ids of list `source` before `offset` ids
-- from its tail (a message waiting in the order also counts as withdrawn there); returns how
-- many ids it read
local function remove_window(source, offset, in_order)
    local window = redis.call("lrange", source, -(offset + batch), -(offset + 1))
    local rids = {} -- tail first
    for i = #window, 1, -1 do
        rids[#rids + 1] = window[i]
    end
    local got
    rids, got = read_bodies(list .. ".msgs", rids)
    for _, found in ipairs(matching(rids, got)) do
        local rid, message = found[1], found[2]
        if redis.call("hexists", root .. "inflight", rid) == 0 then
            removed = removed + 1
            if not dry then
                count_body(list .. ".msgs", rid, found[3], -1)
                redis.call("hdel", list .. ".msgs", rid)
                redis.call("sadd", list .. ":withdrawn", rid)
                if in_order then
                    route_withdrawn(list, found[3], 1)
                end
                free_dedup(root, job, message)
                batch_message_cancelled(root, message, tonumber(ARGV[7]))
            end
        end
    end
    return #rids
end

if mode == "queued" or mode == "suspects" then
    local source = list
    if mode == "suspects" then
        source = root .. "suspects:" .. queue
    end
    local offset = tonumber(cursor)
    local length = redis.call("llen", source)
    if offset >= length then
        return {0, "0", 0, 0}
    end
    offset = offset + remove_window(source, offset, false)
    if offset >= length then
        return {removed, "0", spent, read}
    end
    return {removed, tostring(offset), spent, read}
elseif mode == "order" then
    -- the lists of the queue's order (include/route.lua), level by level, each level's keys
    -- by rank in its ring, each list from its tail: cursor "<level>.<rank>.<offset>"
    local level, rank, offset = string.match(cursor, "^(%d)%.(%d+)%.(%d+)$")
    level, rank, offset = level or "0", tonumber(rank or "0"), tonumber(offset or "0")
    local skipped = 0
    for _, each in ipairs(redis.call("zrangebyscore", list .. ":order", tonumber(level), "+inf")) do
        if each ~= level then
            rank, offset = 0, 0
        end
        local ring = list .. ":ring:" .. each
        while skipped < batch do
            local key = redis.call("lindex", ring, rank)
            if not key then
                break
            end
            local source = list .. ":at:" .. each .. ":" .. key
            if (each == "0" and key == "") or offset >= redis.call("llen", source) then
                rank, offset, skipped = rank + 1, 0, skipped + 1 -- <list> is walked as queued
            else
                offset = offset + remove_window(source, offset, true)
                return {removed, each .. "." .. rank .. "." .. offset, spent, read}
            end
        end
        if skipped >= batch then
            return {removed, each .. "." .. rank .. ".0", spent, read}
        end
    end
    return {removed, "0", spent, read}
elseif mode == "delayed" then
    local bodies = list .. ".DQ.msgs"
    local reply = redis.call("hscan", bodies, cursor, "COUNT", batch)
    local entries = reply[2]
    for i = 1, #entries, 2 do
        local rid, body = entries[i], entries[i + 1]
        spent, read = spent + #body, read + 1
        local message = of_job(body)
        if message then
            removed = removed + 1
            if not dry then
                redis.call("zrem", list .. ".DQ:schedule", rid)
                count_body(bodies, rid, body, -1)
                redis.call("hdel", bodies, rid)
                free_dedup(root, job, message)
                batch_message_cancelled(root, message, tonumber(ARGV[7]))
            end
        end
    end
    return {removed, reply[1], spent, read}
elseif mode == "parked" then
    local parked = root .. "parked:" .. job
    local withdrawn = root .. "parked-withdrawn:" .. job
    if dry then
        local offset = tonumber(cursor)
        local window = redis.call("lrange", parked, offset, offset + batch - 1)
        local rids, got = read_bodies(list .. ".msgs", window)
        for _, found in ipairs(matching(rids, got)) do
            if redis.call("sismember", withdrawn, found[1]) == 0 then
                removed = removed + 1
            end
        end
        if #rids == #window and #window < batch then
            return {removed, "0", spent, read}
        end
        return {removed, tostring(offset + #rids), spent, read}
    end
    local window = redis.call("lrange", parked, 0, batch - 1)
    if #window == 0 then
        redis.call("del", withdrawn)
        return {0, "0", 0, 0}
    end
    local rids, got = read_bodies(list .. ".msgs", window)
    redis.call("lpop", parked, #rids)
    for _, found in ipairs(matching(rids, got)) do
        if redis.call("srem", withdrawn, found[1]) == 0 then
            removed = removed + 1
        end
        count_body(list .. ".msgs", found[1], found[3], -1)
        redis.call("hdel", list .. ".msgs", found[1])
        free_dedup(root, job, found[2])
        batch_message_cancelled(root, found[2], tonumber(ARGV[7]))
    end
    if #rids == #window and #window < batch then
        redis.call("del", withdrawn)
        return {removed, "0", spent, read}
    end
    return {removed, "1", spent, read}
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
        local window = redis.call("lrange", source, 0, budget - 1)
        if #window == 0 then
            redis.call("zrem", waiting, group)
            return 0, true
        end
        local rids, got = read_bodies(msgs, window)
        if #rids == 0 then
            return 0, false -- the step's bytes are spent: the next step starts here
        end
        redis.call("lpop", source, #rids)
        for i, rid in ipairs(rids) do
            local message = of_job(got[i])
            -- every waiter was counted while it waited (as the fetch's serve uncounts it)
            if redis.call("hincrby", root .. "capwaits", job, -1) <= 0 then
                redis.call("hdel", root .. "capwaits", job)
            end
            if got[i] then
                count_body(msgs, rid, got[i], -1)
                redis.call("hdel", msgs, rid)
                redis.call("hdel", root .. "inflight", rid)
                if message then
                    removed = removed + 1
                    free_dedup(root, job, message)
                    batch_message_cancelled(root, message, tonumber(ARGV[7]))
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
            return {removed, "0j", spent, read}
        end
        return {removed, "g0", spent, read}
    end
    local rank = tonumber(string.sub(cursor, 2)) or 0
    local groups = redis.call("zrange", waiting, rank, rank + 19)
    local budget = batch
    for _, group in ipairs(groups) do
        local owner = string.match(group, "^(.-):tenant:%d+:")
            or string.match(group, "^(.*):fair:%x*$") or group
        if owner ~= job or group == job or dry then
            rank = rank + 1
            if owner == job and group ~= job then
                budget = budget - take(group, budget)
            end
        else
            local taken, emptied = take(group, budget)
            budget = budget - taken
            if not emptied then
                return {removed, "g" .. rank, spent, read}
            end
        end
        if budget <= 0 then
            return {removed, "g" .. rank, spent, read}
        end
    end
    if #groups < 20 then
        return {removed, "0", spent, read}
    end
    return {removed, "g" .. rank, spent, read}
elseif mode == "dead" then
    local letters = namespace .. ":" .. queue .. ".XQ"
    -- "0" at the start, then "d<offset>": an offset that is 0 again (the step removed all
    -- it read) must not read as the end of the walk
    local offset = tonumber(string.match(cursor, "%d+$")) or 0
    local window = redis.call("zrange", letters, offset, offset + batch - 1)
    local rids, got = read_bodies(letters .. ".msgs", window)
    local kept = #rids
    for _, found in ipairs(matching(rids, got)) do
        removed = removed + 1
        if not dry then
            redis.call("zrem", letters, found[1])
            count_body(letters .. ".msgs", found[1], found[3], -1)
            redis.call("hdel", letters .. ".msgs", found[1])
            redis.call("del", root .. "dead:" .. found[2].message_id)
            kept = kept - 1
        end
    end
    if #rids == #window and #window < batch then
        return {removed, "0", spent, read}
    end
    return {removed, "d" .. (offset + kept), spent, read}
end
return redis.error_reply("purge_step: unknown mode " .. tostring(mode))
