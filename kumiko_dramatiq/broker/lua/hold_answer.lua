-- hold_answer: a worker answers the asks about messages it holds (include/holds.lua).
-- KEYS[1] namespace
-- ARGV[1..2] dispatch head (see include/dispatch.lua; the worker's lane queue)
-- ARGV[3] the kumiko root "kumiko:<prefix>:"   ARGV[4] "<TTL ms of completed and cancelled run
-- records> <of failed ones> <of a "sent" tombstone>"
-- ARGV[5..] pairs: a redis id and what the worker did: "dropped" (it was held and never
-- starts: done as the ask's kind says, hold_drop), "started", or "held" (a probe: kept)
-- An ask no longer pending (answered, or taken over by its requester) is skipped. Returns how
-- many asks it answered.
-- @include dispatch
-- @include holds
local root = ARGV[3]
local ttls = hold_ttls(ARGV[4])
local asks = root .. "asks:" .. worker
local answered = 0
for i = 5, #ARGV, 2 do
    local rid, outcome = ARGV[i], ARGV[i + 1]
    local ask = redis.call("hget", asks, rid)
    if ask then
        local _, kind = hold_parse(ask)
        local answer = outcome
        if outcome == "dropped" then
            answer = hold_drop(namespace, root, queue, worker, rid, kind, now, ttls)
        end
        hold_settle_ask(root, worker, rid, ask, answer)
        answered = answered + 1
    end
end
return answered
