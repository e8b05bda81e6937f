-- include "batch": the records of batches and chains (kumiko_dramatiq/workflows/batches.py),
-- and the one step that counts a child's end.
-- Keys, under the dataset's root "kumiko:<prefix>:" (`root`), for a batch id B:
--   batch:B            hash: kind ("batch" | "chain" | "step"), state ("writing" while its
--                      children are written, then "running", then "succeeded" | "failed" |
--                      "cancelled"), total, pending, completed, dead, cancelled (children),
--                      created, started, ended (ms), ns (Dramatiq's namespace), ttl (ms its
--                      records live once ended), on_complete / on_success (the callback to
--                      enqueue: "<queue>\t<redis id>\t<encoded message>"), callbacks (how
--                      many have not ended), cancel ("1": cancel_batch asked), "cb:<id>" (a
--                      callback's end, counted once), "a:<id>" (a child added by a running
--                      child, counted once); a chain: steps, step (the running one); a step
--                      of chain C (id "C.<n>"): chain, step, group ("1": a list of jobs)
--   batch:B:children   list of the children's ids, in dispatch order: a child's id is the
--                      id its dispatch returned (its origin id), "<origin>/<tenant>" for a
--                      per-tenant child (batch_member)
--   batch:B:ended      hash child id -> "<head JSON>\n<value JSON>": how it ended (s status,
--                      j job, t tenant, et/em error), then its value (null for none); a
--                      child is counted the first time its id is set here, never again
--   batch:B:staged     list of children written but not yet on their queues, three
--                      entries each: queue, redis id, encoded message (no string to split)
--   batches            zset of batch and chain ids by creation time (listing)
--   batch-outcomes     hash outcome -> batches and chains ended so (kumiko_batches_total)
-- While written ("writing") a batch's keys expire (an abandoned write leaves nothing); once
-- open they are kept until it ended and its callbacks ended, then they live `ttl`.
-- batch_open(key, now) -> the state after (a written batch opens: counts set, keys kept)
-- batch_move(key, ns, limit) -> staged children left, after moving up to `limit` onto their
--   queues (at most one move per batch per call beyond the caller's own)
-- batch_child_ended(root, batch, child, status, head, value, now, deferred): count the child's
--   end (status "completed" | "dead" | "cancelled"; head: its JSON, see :ended) once; with
--   `deferred` its counters are written by the caller's batch_flush(root, now), once per call
-- batch_head(status, job, tenant, error type, error message) -> the head JSON of a child's end
-- batch_run_ended(root, run, status, now): the same for a decoded run record table (run_of
--   in include/history.lua: its b = batch, cb = the batch it is a callback of)
-- batch_callback_ended(root, batch, id): a callback ended; the last lets the records expire
-- batch_join(root, key, ids) -> how many of `ids` joined the running batch at `key` as new
--   children (an id joins once: "a:<id>"); an error when it is not running
-- batch_message_cancelled(root, message, now): the same for a decoded message taken out
--   before it ran (a purge)
-- @include enqueue
-- @include body

local BATCH_MOVE_STEP = 250

-- @per-call
local batch_moved, batch_heads, batch_unstaged, batch_counts, batch_counted = {}, {}, {}, {}, {}
-- @end per-call

-- the id a child is counted by: its origin id ("" tenant: none), with its tenant if it has one
local function batch_member(origin, tenant)
    if tenant and tenant ~= "" then
        return origin .. "/" .. tenant
    end
    return origin
end

local function batch_key(root, id)
    return root .. "batch:" .. id
end

local function batch_expire(key, ttl)
    for _, each in ipairs({key, key .. ":children", key .. ":ended", key .. ":staged"}) do
        redis.call("pexpire", each, ttl)
    end
end

local function batch_enqueue(ns, entry)
    local queue, rid, body = string.match(entry, "^([^\t]*)\t([^\t]*)\t(.*)$")
    if not queue then
        error("kumiko: malformed batch entry " .. string.sub(entry, 1, 60))
    end
    local list = ns .. ":" .. queue
    enqueue_message(list .. ".msgs", list, rid, body)
end

local function batch_open(key, now)
    local state = redis.call("hget", key, "state")
    if state ~= "writing" then
        return state
    end
    local total = redis.call("llen", key .. ":children")
    redis.call("hset", key, "state", "running", "total", total, "pending", total,
        "completed", 0, "dead", 0, "cancelled", 0, "started", now)
    for _, each in ipairs({key, key .. ":children", key .. ":ended", key .. ":staged"}) do
        redis.call("persist", each)
    end
    return "running"
end

local function batch_move(key, ns, limit)
    batch_moved[key] = true
    local staged = key .. ":staged"
    local entries = redis.call("lpop", staged, 3 * limit)
    if entries then
        for i = 1, #entries, 3 do
            local list = ns .. ":" .. entries[i]
            enqueue_message(list .. ".msgs", list, entries[i + 1], entries[i + 2])
        end
    end
    local left = redis.call("llen", staged) / 3
    if left == 0 then
        batch_unstaged[key] = true
    end
    return left
end

-- the value of a step (one job: its value; a group: the list of its values in order)
local function step_value(key, group)
    local children = redis.call("lrange", key .. ":children", 0, -1)
    local values = {}
    for start = 1, #children, 1000 do
        local ids = {}
        for i = start, math.min(start + 999, #children) do
            ids[#ids + 1] = children[i]
        end
        for _, entry in ipairs(redis.call("hmget", key .. ":ended", unpack(ids))) do
            local value = entry and string.match(entry, "\n(.*)$") or "null"
            values[#values + 1] = value
        end
    end
    if group then
        return "[" .. table.concat(values, ",") .. "]"
    end
    return values[1] or "null"
end

-- a batch or chain ended: counted by outcome; the index forgets entries over a year and a
-- day old (their records expired long since, unless one ran that long; `kumiko batches`
-- drops the others as it meets them)
local BATCH_INDEX_AGE_MS = 367 * 86400000
local function batch_ended_as(root, outcome, now)
    redis.call("hincrby", root .. "batch-outcomes", outcome, 1)
    redis.call("zremrangebyscore", root .. "batches", "-inf", "(" .. (now - BATCH_INDEX_AGE_MS))
end

-- step n of chain `chain` ended with `outcome`: the next step opens, or the chain ends
local function chain_step_ended(root, chain, step, outcome, step_key, group, now)
    local key = batch_key(root, chain)
    local head = redis.call("hmget", key, "state", "cancel", "steps", "ttl", "ns")
    if head[1] ~= "running" then
        return
    end
    local steps = tonumber(head[3])
    if outcome == "succeeded" and step < steps and not head[2] then
        local next_key = batch_key(root, chain .. "." .. (step + 1))
        redis.call("hset", key, "step", step + 1)
        batch_open(next_key, now)
        batch_move(next_key, head[5], BATCH_MOVE_STEP)
        return
    end
    local ended = outcome
    if outcome ~= "succeeded" then
        ended = head[2] and "cancelled" or "failed"
    end
    for later = step + 1, steps do
        local later_key = batch_key(root, chain .. "." .. later)
        local never = redis.call("llen", later_key .. ":children")
        redis.call("hincrby", key, "pending", -never)
        redis.call("hincrby", key, "cancelled", never)
        redis.call("hset", later_key, "state", "cancelled", "ended", now)
        redis.call("del", later_key .. ":staged")
    end
    redis.call("hset", key, "state", ended, "ended", now)
    batch_ended_as(root, ended, now)
    local ttl = head[4]
    local announced = chain
    if ended == "succeeded" then
        local value = step_value(step_key, group)
        redis.call("set", root .. "result:" .. chain, value, "PX", ttl)
        if #value <= 8192 then
            announced = chain .. "\t\t" .. value
        end
    end
    for each = 1, steps do
        batch_expire(batch_key(root, chain .. "." .. each), ttl)
    end
    batch_expire(key, ttl)
    redis.call("publish", root .. "results", announced)
end

-- every child of the batch at `key` ended: its outcome, its callbacks (or its chain moves on)
local function batch_finish(root, key, now)
    local f = redis.call("hmget", key, "state", "cancel", "total", "completed", "on_complete",
        "on_success", "ns", "ttl", "chain", "step", "group")
    if f[1] ~= "running" then
        return
    end
    local outcome = "failed"
    if f[2] then
        outcome = "cancelled"
    elseif tonumber(f[4]) >= tonumber(f[3]) then
        outcome = "succeeded"
    end
    redis.call("hset", key, "state", outcome, "ended", now)
    if f[9] then
        chain_step_ended(root, f[9], tonumber(f[10]), outcome, key, f[11] == "1", now)
        return
    end
    batch_ended_as(root, outcome, now)
    local callbacks = 0
    if f[5] then
        batch_enqueue(f[7], f[5])
        callbacks = callbacks + 1
    end
    if f[6] and outcome == "succeeded" then
        batch_enqueue(f[7], f[6])
        callbacks = callbacks + 1
    end
    if callbacks > 0 then
        redis.call("hset", key, "callbacks", callbacks)
    else
        batch_expire(key, f[8])
    end
end

-- the ends counted so far this call, written by batch_flush: one HINCRBY per counter and
-- batch for all of a settle's children of one batch
local function batch_count(key, state, status)
    local counts = batch_counts[key]
    if not counts then
        counts = {completed = 0, dead = 0, cancelled = 0, n = 0, chain = state[2], ns = state[3]}
        batch_counts[key] = counts
        batch_counted[#batch_counted + 1] = key
    end
    counts[status] = counts[status] + 1
    counts.n = counts.n + 1
end

local BATCH_COUNTERS = {"completed", "dead", "cancelled"}

local function batch_flush(root, now)
    local counted = batch_counted
    batch_counted = {}
    for _, key in ipairs(counted) do
        local counts = batch_counts[key]
        batch_counts[key] = nil
        local pending = redis.call("hincrby", key, "pending", -counts.n)
        local chain_key = counts.chain and batch_key(root, counts.chain)
        if chain_key then
            redis.call("hincrby", chain_key, "pending", -counts.n)
        end
        for _, status in ipairs(BATCH_COUNTERS) do
            if counts[status] > 0 then
                redis.call("hincrby", key, status, counts[status])
                if chain_key then
                    redis.call("hincrby", chain_key, status, counts[status])
                end
            end
        end
        if pending <= 0 then
            batch_finish(root, key, now)
            batch_heads[key] = nil
        elseif not batch_moved[key] and not batch_unstaged[key] then
            -- a writer that stopped after it opened the batch left children staged: every
            -- end moves the next ones once few of those moved are left
            local staged = redis.call("llen", key .. ":staged") / 3
            if staged == 0 then
                batch_unstaged[key] = true
            elseif pending - staged < BATCH_MOVE_STEP / 2 then
                batch_move(key, counts.ns, BATCH_MOVE_STEP)
            end
        end
    end
end

-- deferred: the caller calls batch_flush before it returns (a settle, for all its deliveries)
local function batch_child_ended(root, batch, child, status, head, value, now, deferred)
    local key = batch_key(root, batch)
    local state = batch_heads[key] -- read once per call: a settle ends many of one batch
    if not state then
        state = redis.call("hmget", key, "state", "chain", "ns")
        batch_heads[key] = state
    end
    if state[1] ~= "running" then
        return -- unknown, expired, or ended already (a child run again after its end)
    end
    if redis.call("hsetnx", key .. ":ended", child, head .. "\n" .. (value or "null")) == 0 then
        return -- counted before: the count is by child
    end
    batch_count(key, state, status)
    if not deferred then
        batch_flush(root, now)
    end
end

-- the head of a child's end (see :ended): a job name needs no escaping (the registry's names)
local function batch_head(status, job, tenant, error_type, error_message)
    if not tenant and not error_type and not error_message then
        return '{"s":"' .. status .. '","j":"' .. job .. '"}'
    end
    return cjson.encode({s = status, j = job, t = tenant, et = error_type, em = error_message})
end

local function batch_join(root, key, ids)
    local head = redis.call("hmget", key, "state", "chain")
    if head[1] ~= "running" then
        error("kumiko: batch " .. string.sub(key, #root + 7) .. " is "
            .. tostring(head[1] or "gone") .. ", not running: no child can join it")
    end
    local joined = {}
    for _, id in ipairs(ids) do
        if redis.call("hsetnx", key, "a:" .. id, "1") == 1 then
            joined[#joined + 1] = id
        end
    end
    if #joined > 0 then
        redis.call("rpush", key .. ":children", unpack(joined))
        redis.call("hincrby", key, "total", #joined)
        redis.call("hincrby", key, "pending", #joined)
        if head[2] then
            redis.call("hincrby", batch_key(root, head[2]), "total", #joined)
            redis.call("hincrby", batch_key(root, head[2]), "pending", #joined)
        end
    end
    return #joined
end

local function batch_callback_ended(root, batch, id)
    local key = batch_key(root, batch)
    if redis.call("exists", key) == 0 or redis.call("hsetnx", key, "cb:" .. id, "1") == 0 then
        return
    end
    if redis.call("hincrby", key, "callbacks", -1) <= 0 then
        batch_expire(key, redis.call("hget", key, "ttl") or 1)
    end
end

local function batch_run_ended(root, run, status, now)
    if run.b then
        batch_child_ended(root, run.b, batch_member(run.o, run.t), status,
            batch_head(status, run.j, run.t, run.et, run.em), nil, now)
    end
    if run.cb then
        batch_callback_ended(root, run.cb, run.m)
    end
end

local function batch_message_cancelled(root, message, now)
    local options = message.options
    local function text(value)
        return type(value) == "string" and value or nil
    end
    local batch, callback_of = text(options.kumiko_batch), text(options.kumiko_batch_callback)
    if not batch and not callback_of then
        return
    end
    batch_run_ended(root, {
        b = batch, cb = callback_of, m = message.message_id,
        o = text(options.kumiko_origin_id) or message.message_id,
        j = job_of(text(message.actor_name) or ""), t = text(options.kumiko_tenant_id),
    }, "cancelled", now)
end
