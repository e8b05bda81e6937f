-- include "counts": exact per-job message counts, kept by every script that writes or deletes
-- a message body (one line each: count_body after a write, uncount before a delete).
--   <namespace>:<queue>:counts   hash (keys.queue_counts), beside Dramatiq's layout:
--       "q:<actor>"  bodies in <queue>.msgs (queued, parked, waiting for a slot, running)
--       "d:<actor>"  bodies in <queue>.DQ.msgs (delayed, backing off)
--       "x:<actor>"  bodies in <queue>.XQ.msgs (dead letters)
--       "~mode"      absent: not counted yet (nothing is counted; the first body written to a
--                    queue that holds no other starts it "r", see counts_start); "b":
--                    counting while the backfill counts what was there before
--                    (lua/counts_backfill.lua); "r": ready, exact
-- While the backfill runs, a body written is noted in "<counts>:fresh" (the backfill skips
-- it) and a body deleted is uncounted only if it was fresh or the backfill counted it already
-- ("<counts>:seen"; it leaves the set it was in, so both hold live bodies only, also if a
-- backfill is cut short and not taken up for a while), so every body is counted exactly once. The actor is read off the body
-- (Dramatiq writes "actor_name" before the payload), never by decoding it whole.
-- @include group
-- @include body

local function counts_of(messages)
    -- suffix checks, not patterns: this runs for every body written or deleted
    if string.sub(messages, -5) ~= ".msgs" then
        return nil, nil
    end
    local tail = string.sub(messages, -8, -6)
    if tail == ".DQ" then
        return string.sub(messages, 1, -9) .. ":counts", "d"
    elseif tail == ".XQ" then
        return string.sub(messages, 1, -9) .. ":counts", "x"
    end
    return string.sub(messages, 1, -6) .. ":counts", "q"
end

-- the counts mode of each counts hash read in this call (only counts_backfill, another
-- script, changes a mode)
-- @per-call
local counts_modes = {}
-- @end per-call
local function counts_mode(counts)
    local mode = counts_modes[counts]
    if mode == nil then
        mode = redis.call("hget", counts, "~mode")
        counts_modes[counts] = mode
    end
    return mode
end

-- counts_start(counts): a queue whose counts are not kept yet, when the body just written is
-- the only one it holds (queued, delayed or dead): its counts start out ready ("r"), so a
-- dataset written only by this version never needs the backfill; else nil (what it held
-- before is counted by lua/counts_backfill.lua first)
local function counts_start(counts)
    local base = string.sub(counts, 1, -8)
    local held = 0
    for _, suffix in ipairs({".msgs", ".DQ.msgs", ".XQ.msgs"}) do
        local n = redis.pcall("hlen", base .. suffix)  -- a key of another type: not empty
        held = held + (type(n) == "number" and n or 2)
    end
    if held ~= 1 then
        return nil
    end
    redis.call("hset", counts, "~mode", "r")
    counts_modes[counts] = "r"
    return "r"
end

-- count_body(messages, rid, body, delta, counted): body (of redis id rid) was written to (+1)
-- or is about to leave (-1) message hash `messages`. counted: {counts hash, field}, its
-- count's names as the caller knows them (the hash of `messages`' queue, "<kind>:<actor>"
-- of body's actor), or nil: then they are found from `messages` and the body (about 8,000
-- instructions: new strings cost Redis's Lua about 12 instructions a byte)
local function count_body(messages, rid, body, delta, counted)
    if not body then
        return
    end
    local counts, kind, field
    if counted then
        counts, field = counted[1], counted[2]
        kind = string.sub(field, 1, 1)
    else
        counts, kind = counts_of(messages)
    end
    if not counts then
        return
    end
    local mode = counts_mode(counts)
    if not mode then
        if delta < 0 then
            return
        end
        mode = counts_start(counts)
        if not mode then
            return
        end
    end
    if not field then
        local actor = actor_of(body)
        if not actor then
            return
        end
        field = kind .. ":" .. actor
    end
    if mode == "b" then
        local member = kind .. rid
        if delta > 0 then
            redis.call("sadd", counts .. ":fresh", member)
        elseif redis.call("srem", counts .. ":fresh", member) == 0
            and redis.call("srem", counts .. ":seen", member) == 0 then
            return
        end
    end
    redis.call("hincrby", counts, field, delta > 0 and "1" or "-1")
end

-- uncount(messages, rid): the body of rid is about to be deleted from `messages`
local function uncount(messages, rid)
    count_body(messages, rid, redis.call("hget", messages, rid), -1)
end

-- note_uncount(deltas, counts, kind, mode, rid, actor): add rid's -1 to deltas (field ->
-- change, and its list of fields in order) unless a backfill is running that has not counted
-- it (mode "b": see the head of this file)
local function note_uncount(deltas, counts, kind, mode, rid, actor)
    if mode == "b" and redis.call("srem", counts .. ":fresh", kind .. rid) == 0
        and redis.call("srem", counts .. ":seen", kind .. rid) == 0 then
        return
    end
    local field = kind .. ":" .. actor
    if not deltas[field] then
        deltas[field] = 0
        deltas[#deltas + 1] = field
    end
    deltas[field] = deltas[field] - 1
end

local function write_deltas(counts, deltas)
    for _, field in ipairs(deltas) do
        redis.call("hincrby", counts, field, string.format("%d", deltas[field]))
    end
end

-- uncount_many(messages, rids): the bodies of rids (distinct) are about to be deleted from
-- `messages`: as uncount for each, with one read of the bodies and one HINCRBY per actor
local function uncount_many(messages, rids)
    if #rids == 0 then
        return
    end
    local counts, kind = counts_of(messages)
    if not counts then
        return
    end
    local mode = counts_mode(counts)
    if not mode then
        return
    end
    local bodies = redis.call("hmget", messages, unpack(rids))
    local deltas = {}
    for i, rid in ipairs(rids) do
        local actor = bodies[i] and actor_of(bodies[i])
        if actor then
            note_uncount(deltas, counts, kind, mode, rid, actor)
        end
    end
    write_deltas(counts, deltas)
end

-- forget_bodies(messages, rids, actors): delete the bodies of rids (distinct) from
-- `messages`, uncounting each one that was there. actors[i] is rid's actor name as the
-- caller decoded it from that body, or "" if not known: a known one's body is not read (one
-- HDEL per actor says how many of its bodies were there, with ready counts; one per body
-- while a backfill runs, which looks at each; a body may be gone, a cancel or a purge
-- deletes the body of a message out with a worker), an unknown one's is, as uncount_many
-- reads it. A body is about 12 instructions a byte to bring into Lua: reading it costs more
-- than the HDELs.
local function forget_bodies(messages, rids, actors)
    if #rids == 0 then
        return
    end
    local counts, kind = counts_of(messages)
    local mode = counts and counts_mode(counts)
    if not mode then
        redis.call("hdel", messages, unpack(rids))
        return
    end
    local unknown, deltas = {}, {}
    if mode == "b" then
        for i, rid in ipairs(rids) do
            local actor = actors[i]
            if actor == "" then
                unknown[#unknown + 1] = rid
            elseif redis.call("hdel", messages, rid) == 1 then
                note_uncount(deltas, counts, kind, mode, rid, actor)
            end
        end
        write_deltas(counts, deltas)
    else
        -- ready counts: one HDEL per actor (its reply is how many of that actor's bodies were
        -- there), not one per body
        local of_actor, order = {}, {}
        for i, rid in ipairs(rids) do
            local actor = actors[i]
            if actor == "" then
                unknown[#unknown + 1] = rid
            else
                group_add(of_actor, order, actor, rid)
            end
        end
        for _, actor in ipairs(order) do
            local gone = redis.call("hdel", messages, unpack(of_actor[actor]))
            if gone > 0 then
                redis.call("hincrby", counts, kind .. ":" .. actor, string.format("%d", -gone))
            end
        end
    end
    if #unknown > 0 then
        uncount_many(messages, unknown)
        redis.call("hdel", messages, unpack(unknown))
    end
end

-- uncount_all(messages): `messages` and its queue's dead letters are about to be deleted whole
-- (Dramatiq's purge); their counts start again from zero
local function uncount_all(messages)
    local counts, kind = counts_of(messages)
    if not counts or not counts_mode(counts) then
        return
    end
    for _, field in ipairs(redis.call("hkeys", counts)) do
        local head = string.sub(field, 1, 2)
        if head == kind .. ":" or head == "x:" then
            redis.call("hdel", counts, field)
        end
    end
end
