-- include "holds": the messages a worker claimed ahead of its threads (held: claimed, not
-- started), their starts, and the asks about them. The protocol, and why it is safe, is
-- kumiko_dramatiq/broker/holds.py's; this piece is its Redis side.
-- A claim writes a message it takes for a thread that is free now as running and one it takes
-- ahead as held (include/inflight.lua); the worker reports the start of a held message in its
-- next lane call (the hold block, hold_report), which makes the entry running. A held message
-- is not running anywhere: cancel, purge, pause and stop_run ask its worker about it instead.
-- Keys, under the dataset's root "kumiko:<prefix>:" (W: a worker's broker id, the ack sets'
-- and the dispatch head's worker):
--   asks:<W>      hash redis id -> "<request id>\t<kind>\t<waiters>": what requesters ask about
--                 W's held message (kinds, strongest first: "cancel" never start it, it is
--                 cancelled; "purge" never start it, it is deleted; "back" never start it, it
--                 goes back to the head of its queue; "probe" only say whether it started);
--                 <waiters> requesters wait for its answer. Lives HOLD_ASKS_TTL_MS past the
--                 last ask (each ask is answered within about a second, by W or by a takeover)
--   askbell:<W>   list: a token once an ask waits, W's keeper waits on it (BLPOP)
--   answer:<id>   list: the answers to request <id>, "<redis id>\t<answer>" once per waiter
--                 of that message's ask; the answer "started", "dropped"
--                 (held, never starts: done as asked), "held" (a probe's: held, kept) or
--                 "gone" (not W's: settled, recovered or taken over); kept HOLD_ANSWER_TTL_MS
-- @include inflight
-- @include cancelling
-- @include body
-- @include bell

local HOLD_ANSWER_TTL_MS = "60000"
local HOLD_ASKS_TTL_MS = "60000"
local HOLD_KINDS = {cancel = 4, purge = 3, back = 2, probe = 1}

local function hold_ack_set(namespace, holder, queue)
    return namespace .. ":__acks__." .. holder .. "." .. queue
end

-- holder_of(namespace, queue, rid): the broker id of the worker whose ack set of queue holds
-- rid (live or presumed dead), or nil. O(workers).
local function holder_of(namespace, queue, rid)
    for _, each in ipairs(redis.call("zrange", namespace .. ":__heartbeats__", 0, -1)) do
        if redis.call("sismember", hold_ack_set(namespace, each, queue), rid) == 1 then
            return each
        end
    end
    return nil
end

-- hold_ask(root, holder, rid, request, kind): ask holder about its held message rid and ring
-- its keeper; a second ask about the same message joins the first (the stronger kind, one
-- more waiter). Returns the request id to wait on.
local function hold_ask(root, holder, rid, request, kind)
    local asks = root .. "asks:" .. holder
    local pending = redis.call("hget", asks, rid)
    if pending then
        local was, was_kind, waiters = string.match(pending, "^([^\t]*)\t([^\t]*)\t(%d+)$")
        if was then
            if (HOLD_KINDS[kind] or 0) > (HOLD_KINDS[was_kind] or 0) then
                was_kind = kind
            end
            redis.call("hset", asks, rid, was .. "\t" .. was_kind .. "\t" .. (waiters + 1))
            redis.call("pexpire", asks, HOLD_ASKS_TTL_MS)
            return was
        end
    end
    redis.call("hset", asks, rid, request .. "\t" .. kind .. "\t1")
    redis.call("pexpire", asks, HOLD_ASKS_TTL_MS)
    local bell = root .. "askbell:" .. holder
    if redis.call("exists", bell) == 0 then
        redis.call("rpush", bell, "1")
        redis.call("pexpire", bell, HOLD_ASKS_TTL_MS)
    end
    return request
end

-- hold_parse(ask): request id, kind, waiters of an ask's value
local function hold_parse(ask)
    local request, kind, waiters = string.match(ask, "^([^\t]*)\t([^\t]*)\t(%d+)$")
    return request, kind, tonumber(waiters) or 1
end

-- hold_settle_ask(root, holder, rid, ask, answer, skip): answer the pending ask about rid (its
-- value `ask`) once per waiter but `skip` (the caller, answered by the return value: 0 or 1),
-- and remove it
local function hold_settle_ask(root, holder, rid, ask, answer, skip)
    local request, _, waiters = hold_parse(ask)
    local key = root .. "answer:" .. request
    for _ = 1 + (skip or 0), waiters do
        redis.call("rpush", key, rid .. "\t" .. answer)
    end
    redis.call("pexpire", key, HOLD_ANSWER_TTL_MS)
    redis.call("hdel", root .. "asks:" .. holder, rid)
end

-- hold_drop(namespace, root, queue, holder, rid, kind, now, ttls): holder's held message rid
-- on queue leaves it unstarted as kind says (ttls: {completed, failed, sent} ms, for "cancel":
-- its run record says cancelled, its "sent" tombstone is left; "purge": no record; both free
-- its dedup key; "back": its delivery undone, it goes to the head of its queue). Returns
-- "dropped", or "gone" when rid is no longer the holder's.
local function hold_drop(namespace, root, queue, holder, rid, kind, now, ttls)
    if kind == "probe" then
        return "held"
    end
    if redis.call("srem", hold_ack_set(namespace, holder, queue), rid) == 0 then
        return "gone"
    end
    local list = namespace .. ":" .. queue
    local messages = list .. ".msgs"
    local inflight = root .. "inflight"
    if kind == "back" then
        local entry = inflight_requeued(redis.call("hget", inflight, rid))
        if entry then
            redis.call("hset", inflight, rid, entry)
        else
            redis.call("hdel", inflight, rid)
        end
        if redis.call("hexists", messages, rid) == 1 then
            redis.call("lpush", list, rid)
            ring(list)
        end
        return "dropped"
    end
    redis.call("hdel", inflight, rid)
    local body = redis.call("hget", messages, rid)
    if body then
        forget_body(messages, rid)
    end
    if kind == "cancel" then
        redis.call("set", root .. "sent:" .. rid, "1", "PX", ttls[3])
        record_cancelled(root, body, now, ttls[1], ttls[2])
    end
    local message = decode_message(body)
    if message and type(message.actor_name) == "string" then
        free_dedup(root, job_of(message.actor_name), message)
    end
    return "dropped"
end

-- hold_ttls(spec): {completed, failed, sent} ms of "<completed TTL> <failed TTL> <sent TTL>"
local function hold_ttls(spec)
    local completed, failed, sent = string.match(spec or "", "^(%d+) (%d+) (%d+)$")
    if not completed then
        error("kumiko: malformed hold TTLs " .. tostring(spec))
    end
    return {tonumber(completed), tonumber(failed), sent}
end

-- hold_report(root, holder, acks, at): the hold block of a lane call of worker `holder` (the
-- dispatch head's worker; `acks` its ack set of the call's queue), from ARGV[at]: "<starts>
-- <checks>", then <starts> pairs (redis id, the ms its held message started, digits), then
-- <checks> redis ids of held messages whose claims are to be checked (the worker's hold ran
-- out). A start of a message still this worker's makes its entry running and answers a
-- pending ask about it ("started"); one that is not (taken over once its hold ran out) is
-- revoked. Returns {revoked ids, checked ids no longer this worker's, the asks still pending:
-- {rid, ask, ...}}.
local function hold_report(root, holder, acks, at)
    local starts, checks = string.match(ARGV[at] or "", "^(%d+) (%d+)$")
    if not starts then
        error("kumiko: malformed hold block " .. tostring(ARGV[at]))
    end
    starts, checks = tonumber(starts), tonumber(checks)
    local asks_key = root .. "asks:" .. holder
    local pending = redis.call("hgetall", asks_key)
    local asked = nil
    if #pending > 0 then
        asked = {}
        for i = 1, #pending, 2 do
            asked[pending[i]] = pending[i + 1]
        end
    end
    local revoked, gone = {}, {}
    if starts > 0 then
        local inflight = root .. "inflight"
        local rids = {}
        for i = 1, starts do
            rids[i] = ARGV[at + 2 * i - 1]
        end
        local members = redis.call("smismember", acks, unpack(rids))
        local entries = redis.call("hmget", inflight, unpack(rids))
        local writes = {}
        for i, rid in ipairs(rids) do
            if members[i] == 1 then
                local entry = entries[i]
                if entry and inflight_held(entry) then
                    writes[#writes + 1] = rid
                    writes[#writes + 1] = inflight_started(entry, ARGV[at + 2 * i])
                end
                local ask = asked and asked[rid]
                if ask then
                    hold_settle_ask(root, holder, rid, ask, "started")
                    asked[rid] = nil
                end
            else
                revoked[#revoked + 1] = rid
            end
        end
        if #writes > 0 then
            redis.call("hset", inflight, unpack(writes))
        end
    end
    if checks > 0 then
        local rids = {}
        local base = at + 2 * starts
        for i = 1, checks do
            rids[i] = ARGV[base + i]
        end
        local members = redis.call("smismember", acks, unpack(rids))
        for i, rid in ipairs(rids) do
            if members[i] == 0 then
                gone[#gone + 1] = rid
            end
        end
    end
    local left = {}
    if asked then
        for rid, ask in pairs(asked) do
            left[#left + 1] = rid
            left[#left + 1] = ask
        end
    end
    return {revoked, gone, left}
end
