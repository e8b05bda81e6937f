-- include "counts": exact per-job message counts, kept by every script that writes or deletes
-- a message body (one line each: count_body after a write, uncount before a delete).
--   <namespace>:<queue>:counts   hash (keys.queue_counts), beside Dramatiq's layout:
--       "q:<actor>"  bodies in <queue>.msgs (queued, parked, waiting for a slot, running)
--       "d:<actor>"  bodies in <queue>.DQ.msgs (delayed, backing off)
--       "x:<actor>"  bodies in <queue>.XQ.msgs (dead letters)
--       "~mode"      absent: not counted yet (nothing is counted); "b": counting while the
--                    backfill counts what was there before (lua/counts_backfill.lua); "r":
--                    ready, exact
-- While the backfill runs, a body written is noted in "<counts>:fresh" (the backfill skips
-- it) and a body deleted is uncounted only if it was fresh or the backfill counted it already
-- ("<counts>:seen"; it leaves the set it was in, so both hold live bodies only, also if a
-- backfill is cut short and not taken up for a while), so every body is counted exactly once. The actor is read off the body
-- (Dramatiq writes "actor_name" before the payload), never by decoding it whole.

local function counts_of(messages)
    local base = string.match(messages, "^(.*)%.DQ%.msgs$")
    if base then
        return base .. ":counts", "d"
    end
    base = string.match(messages, "^(.*)%.XQ%.msgs$")
    if base then
        return base .. ":counts", "x"
    end
    base = string.match(messages, "^(.*)%.msgs$")
    if base then
        return base .. ":counts", "q"
    end
    return nil, nil
end

-- count_body(messages, rid, body, delta): body (of redis id rid) was written to (+1) or is
-- about to leave (-1) message hash `messages`
local function count_body(messages, rid, body, delta)
    if not body then
        return
    end
    local counts, kind = counts_of(messages)
    if not counts then
        return
    end
    local mode = redis.call("hget", counts, "~mode")
    if not mode then
        return
    end
    local actor = string.match(body, '"actor_name":"([^"]*)"')
    if not actor then
        return
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
    redis.call("hincrby", counts, kind .. ":" .. actor, delta)
end

-- uncount(messages, rid): the body of rid is about to be deleted from `messages`
local function uncount(messages, rid)
    count_body(messages, rid, redis.call("hget", messages, rid), -1)
end

-- uncount_all(messages): `messages` and its queue's dead letters are about to be deleted whole
-- (Dramatiq's purge); their counts start again from zero
local function uncount_all(messages)
    local counts, kind = counts_of(messages)
    if not counts or not redis.call("hget", counts, "~mode") then
        return
    end
    for _, field in ipairs(redis.call("hkeys", counts)) do
        local head = string.sub(field, 1, 2)
        if head == kind .. ":" or head == "x:" then
            redis.call("hdel", counts, field)
        end
    end
end
