-- hold_takeover: a requester's step once the hold of the worker it asked ran out without an
-- answer (include/holds.lua): that worker can no longer start the message, so the requester
-- does what it asked for itself.
-- KEYS[1] namespace
-- ARGV[1] the lane queue   ARGV[2] the holder's broker id   ARGV[3] the kumiko root
-- "kumiko:<prefix>:"   ARGV[4] the request id waited on   ARGV[5] the message's redis id
-- ARGV[6] "<TTL ms of completed and cancelled run records> <of failed ones> <of a "sent"
-- tombstone>"   ARGV[7] now (ms)
-- Returns "answered" when the ask is no longer pending (its answer is in the request's answer
-- list for the caller to pop; none: it expired), else the answer, given to every other waiter
-- too: "started" if the holder reported its start (its entry is running), else what hold_drop
-- did for the ask's kind ("dropped", "held" or "gone").
-- @include holds
local namespace, queue, holder, root = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local request, rid = ARGV[4], ARGV[5]
local ask = redis.call("hget", root .. "asks:" .. holder, rid)
if not ask or hold_parse(ask) ~= request then
    return "answered"
end
local _, kind = hold_parse(ask)
local answer
local entry = redis.call("hget", root .. "inflight", rid)
if entry and not inflight_held(entry)
    and redis.call("sismember", hold_ack_set(namespace, holder, queue), rid) == 1 then
    answer = "started"
else
    answer = hold_drop(namespace, root, queue, holder, rid, kind, tonumber(ARGV[7]),
        hold_ttls(ARGV[6]))
end
hold_settle_ask(root, holder, rid, ask, answer, 1)
return answer
