-- settle: the outcomes of one or more deliveries from one kumiko lane queue, in one step.
-- KEYS[1] namespace   KEYS[2] in-flight hash (see fetch_lane)   KEYS[3] the queue's suspects
-- list (see fetch_lane)
-- ARGV[1..2] dispatch head (see include/dispatch.lua)
-- ARGV[3] "<deliveries> <marker TTL ms> <TTL ms of completed and cancelled run records>
--         <TTL ms of failed ones> <record cap> <trim budget> [<tombstone TTL ms> [<vouched>
--         [<hold arguments>]]]":
--         trim budget 0, or how many records beyond the cap to drop now (about once per 32
--         records written, see trim_runs); the tombstone TTL (the resend window) defaults to
--         the marker's; vouched "1": the caller refreshed the TTLs of the job and status
--         indexes of every record it sends here less than a minute ago (put_run in
--         include/history.lua): they are not refreshed again (default "0": they are); hold
--         arguments: how many arguments of the worker's hold block (include/holds.lua:
--         hold_report) follow the extras (default 0: none)
-- ARGV[4] the kumiko root "kumiko:<prefix>:" of the run records
-- Then 11 arguments per delivery, from ARGV[5]:
--   +0 redis message id   +1 outcome: "ack" | "completed" | "retry" (a failed attempt's
--   retry, or a sequential hand-off) | "dead", followed by " <slots key> <owner token>" for a
--   run holding a capped job's slot (include/caps.lua): the slot is given back, whoever's
--   delivery it is now (the token is this delivery's own), and the job's waiters are looked
--   at at once   +2 the key its end writes: its "already completed" marker (outcome
--   "completed"), else its "sent" tombstone, written iff the delivery is this worker's (its
--   body goes: a re-sent enqueue of its first write must not write it again, see
--   include/guarded.lua), or "" for none   +3 .. +7 the run record's header: message id (""
--   = no record; the rest of the header is then ""), attempt, job, status, order score (the
--   attempt's start, ms, digits; "" = now). Status "" writes no record (a sequential
--   hand-off: no attempt happened); "malformed": the message is dead-lettered unrun, and if
--   its body reads as kumiko's, its attempt's record says "dead" with the reason in +8
--   +8 the run record (JSON)   +9 the actor name of the delivered message as the worker
--   decoded it ("" = not known: read off its body; see forget_bodies in include/counts.lua)
--   +10 "+" if the delivery's 9 extra arguments follow the deliveries, "b" if only its
--   extras +7 and +8 do (two arguments: the end of a batch child), else "" (they are
--   then all "": most deliveries have none, and an argument costs Redis's Lua about 1,000
--   instructions however short; a header in one argument to split, about 12,000): the
--   extras of the deliveries that have them, in the deliveries' order, from ARGV[5 + 11 *
--   deliveries]:
--   +0 tenant ("" = none)   +1 origin id ("" = the message id)   +2 the dead letter's note
--   (JSON, outcome "dead"; "" = none), kept as long as dead letters   +3 retry queue (a delay
--   queue if delayed)   +4 retry redis id   +5 the encoded retry (outcome "retry" only; else
--   "")   +6 the dedup key the delivery's job ended with for good
--   (include/dedup_index.lua), "<index key>\t<message id>\t<dedup key>", or "":
--   iff the key's record still points at that message id, it is freed (deleted, with its
--   index entry), whoever's delivery it is now (the job ended for good either way; the owner
--   check makes a second settle a no-op); unless a trigger during the run left a follow-up
--   in it (fid): then nothing of that delivery is written (not its ack, record or marker)
--   and its reply is 2, for the worker to hand the key to the follow-up first
--   (lua/dedup_finish.lua, lua/dedup_handover.lua) and then settle it again without it, so
--   a worker killed in between leaves the delivery to be redelivered, as before the key
--   moved on: the follow-up is never lost behind an acknowledged message. Such a delivery
--   recovered by maintenance meanwhile is taken back (its waiting copy removed, its ack set
--   entry restored); one whose copy another worker took is settled as usual, its record left
--   to that run.   +7 the end of a job that keeps results (with a run record only):
--   "<TTL ms> <JSON value>" (a completed run: the value is set at root .. "result:" ..
--   origin for the TTL), "-" (a dead one: no value), or "": none; either of the first two
--   publishes on root .. "results", where runner.result's waiters listen: the origin id,
--   followed by "\t<job>\t<value>" for a value of at most 8 KiB.
--   A TTL of 0 keeps nothing and announces nothing: the value of a batch child whose job
--   keeps no result, for its batch only (+8).   +8 the batch the delivery's message belongs
--   to (include/batch.lua): "b <batch id>" (a child: its end, completed, dead or cancelled,
--   is counted there once, with its value from +7), "c <batch id>" (one of its callbacks),
--   or "".
-- Each delivery as if settled alone, in order: writes its run record (with the deliveries
-- count when more than one); then, iff the delivery is this worker's: removes its in-flight
-- entry; "ack" and "completed" forget the message, "retry" forgets it and enqueues its retry
-- or hand-off (so a crash can neither lose it nor enqueue it twice; the follow-ups are
-- written first, before anything else of the call, so a write that fails leaves the
-- deliveries untouched), "dead" moves it to the dead letters with its note. A delivery no
-- longer in this worker's ack set was recovered by maintenance while the worker was presumed
-- dead: if its recovered copy still waits (in the queue or the suspects list), the copy is
-- taken back and the delivery settled as if it had stayed this worker's, so no second copy
-- of a settled message is left to run; if another worker took the copy already, only the
-- marker and the record are written (the in-flight entry is that worker's now): it runs
-- there too (at least once). A redis id given twice is settled once (the second is not
-- this worker's any more). Settling again (a reply lost) changes nothing.
-- The writes common to the batch are one command each (ack set, message hash, in-flight
-- hash, each run index, each stats counter).
-- After the deliveries, optionally, the claim of the settling consumer's next messages (a
-- steadily draining consumer then sends no fetch of its own): the arguments after the extras
-- and the hold block, as fetch_lane's ARGV[3..7] (claim head "<N> <messages the consumer
-- holds once these are settled> <max deliveries> <completed TTL> <failed TTL>[ <now>]",
-- "already completed" marker prefix, kumiko root, "host:pid", the slots' lease TTL ms on a
-- lane with capped jobs, "" or absent elsewhere).
-- Claimed after every delivery is settled, exactly as fetch_lane claims (its rules for
-- suspects, paused jobs, cancelled ids, caps and the doorbell); a slot given back here
-- whose job has waiters is offered to this claim first (the doorbell rings for them only if
-- the claim could not take them), so a freed slot's oldest waiter goes to the consumer that
-- has just freed a worker thread: the fastest hand-over there is (no doorbell, no fetch).
-- Returns one number per delivery: 1 if it was (or became again) this worker's, else 0; 2
-- if it was left for its dedup key's follow-up (extra +6); with a claim, {those, fetch_lane's
-- reply}; with a hold block, {those, fetch_lane's reply or {}, how many claimed run now (the
-- first), hold_report's reply}.
-- @include lane_claim
-- @include dispatch
-- @include enqueue
-- @include dead_letter
-- @include ttl
-- @include history
-- @include batch
-- @include caps_release
-- @include holds
local count, marker_ttl, completed_ttl, failed_ttl, cap, trim, tombstone_ttl, vouched, hold_args =
    string.match(ARGV[3], "^(%d+) (%S+) (%S+) (%S+) (%d+) (%d+) ?(%S*) ?([01]?) ?(%d*)$")
if not count then
    error("kumiko: malformed settle batch head " .. tostring(ARGV[3]))
end
count = tonumber(count)
ttl_ms(marker_ttl, "completed marker")
if tombstone_ttl == "" then
    tombstone_ttl = marker_ttl
end
ttl_ms(tombstone_ttl, "sent tombstone")
completed_ttl = ttl_ms(completed_ttl, "completed run record")
failed_ttl = ttl_ms(failed_ttl, "failed run record")
local FIELDS, EXTRAS = 11, 9
local root_of_runs = ARGV[4]
-- each delivery's redis id, and where its extras are (extra_at[i], or nil: none)
local rids, extra_at, extra_short = {}, {}, {}
-- extra k (0-8) of delivery i, "" if it has none
local function extra(i, k)
    local at = extra_at[i]
    if not at then
        return ""
    elseif extra_short[i] then
        if k == 7 then
            return ARGV[at]
        elseif k == 8 then
            return ARGV[at + 1]
        end
        return ""
    end
    return ARGV[at + k]
end
local tail = 5 + count * FIELDS
for i = 1, count do
    local base = 5 + (i - 1) * FIELDS
    rids[i] = ARGV[base]
    local marker = ARGV[base + 10]
    if marker == "b" then
        extra_at[i], extra_short[i] = tail, true
        tail = tail + 2
    elseif marker ~= "" then
        extra_at[i] = tail
        tail = tail + EXTRAS
    end
end
hold_args = tonumber(hold_args) or 0
local claim_at = tail + hold_args
local claiming = ARGV[claim_at] ~= nil
local released = {}

-- The starts of held messages first (a message may start and end between two calls: its
-- entry is running before it is settled), and the asks about what this worker holds.
local hold_reply = nil
if hold_args > 0 then
    hold_reply = hold_report(ARGV[4], worker, queue_acks, tail)
end

-- Whose deliveries are they? Read first: nothing is written before the follow-ups, the one
-- write that can fail on a key it does not own.
local members = redis.call("smismember", queue_acks, unpack(rids))
local entries = redis.call("hmget", KEYS[2], unpack(rids))
local owned, recovered, seen = {}, {}, {}
for i, rid in ipairs(rids) do
    if seen[rid] then
        owned[i] = false
    else
        seen[rid] = true
        owned[i] = members[i] == 1
        if not owned[i] then
            if redis.call("lpos", queue_list, rid) then
                recovered[i] = queue_list
            elseif redis.call("lpos", KEYS[3], rid) then
                recovered[i] = KEYS[3]
            end
        end
    end
end
-- the dedup records of jobs that ended for good: read here too (a record that is not a hash
-- fails the call before it writes anything)
local dedup_ends, deferred = {}, {}
for i = 1, count do
    local field = extra(i, 6)
    if field ~= "" then
        local index, mid, key = string.match(field, "^([^\t]*)\t([^\t]*)\t(.*)$")
        local head, job = string.match(index or "", "^(.-)dedupidx:(.*)$")
        if not head then
            error("kumiko: malformed dedup end " .. field)
        end
        local record = head .. "dedup:" .. job .. ":" .. key
        local live = redis.call("hmget", record, "id", "fid")
        if live[1] == mid then
            dedup_ends[i] = {record, index, key}
            deferred[i] = live[2] ~= false
        end
    end
end
for i = 1, count do
    -- (an encoded retry comes with outcome "retry" only: the common case reads no outcome)
    if extra(i, 5) ~= "" and (owned[i] or recovered[i]) and not deferred[i]
        and string.match(ARGV[5 + (i - 1) * FIELDS + 1], "^%a+") == "retry" then
        local retry_list = namespace .. ":" .. extra(i, 3)
        enqueue_message(retry_list .. ".msgs", retry_list, extra(i, 4), extra(i, 5))
    end
end
-- A delivery left for its key's follow-up stays this worker's: one recovered meanwhile has its
-- waiting copy taken back now (so neither this call's claim nor another consumer runs it while
-- the key is handed over); one whose copy another worker took is not left: that run ends the
-- key, so this one leaves its record alone.
for i = 1, count do
    if deferred[i] and not owned[i] then
        if recovered[i] then
            redis.call("lrem", recovered[i], 0, rids[i])
            redis.call("sadd", queue_acks, rids[i])
            owned[i], recovered[i] = true, nil
        else
            deferred[i], dedup_ends[i] = nil, nil
        end
    end
end

local acked, forgotten, forgotten_actors, out_of_flight, results = {}, {}, {}, {}, {}
local head_now, dead_count = now, 0
local indexed_job = nil
for i, rid in ipairs(rids) do
    if deferred[i] then
        results[i] = 2 -- untouched: the worker hands its key over, then settles it again
    else
        local base = 5 + (i - 1) * FIELDS
        local at = extra_at[i]
        local outcome = ARGV[base + 1]
        local slot_key, slot_token = nil, nil
        if #outcome > 9 and string.find(outcome, " ", 1, true) then -- longer than "completed"
            outcome, slot_key, slot_token = string.match(outcome, "^(%a+) (%S+) (%S+)$")
            if claiming then
                released[#released + 1] = caps_release(slot_key, slot_token, nil)
            else
                caps_release(slot_key, slot_token, queue_list)
            end
        end
        local mine = owned[i] or recovered[i] ~= nil
        local entry = nil
        if mine then
            entry = entries[i] or nil
            out_of_flight[#out_of_flight + 1] = rid
        end
        if outcome == "completed" then
            redis.call("set", ARGV[base + 2], "1", "PX", marker_ttl)
        end
        local root, mid, attempt, job, status, tenant, origin, score
        if ARGV[base + 3] ~= "" then
            root, mid, attempt = root_of_runs, ARGV[base + 3], ARGV[base + 4]
            job, status, score = ARGV[base + 5], ARGV[base + 6], ARGV[base + 7]
            tenant, origin = "", mid
            if at then
                tenant = extra(i, 0)
                if extra(i, 1) ~= "" then
                    origin = extra(i, 1)
                end
            end
        end
        if root and status == "malformed" then
            local claimed_by = inflight_worker(entry)
            local run = run_of(root, redis.call("hget", queue_messages, rid), claimed_by or worker)
            if run then
                run.s, run.en, run.et, run.em = "dead", now, "MalformedMessage", ARGV[base + 8]
                local deliveries = inflight_count(entry)
                if deliveries > 1 then
                    run.n = deliveries
                end
                put_run(root, run.m, run.a, run.j, "dead", run.t or "", run.o, run.q or now,
                    cjson.encode(run), completed_ttl, failed_ttl, now)
                batch_run_ended(root, run, "dead", now)
            end
        elseif root and status ~= "" then
            local record = ARGV[base + 8]
            local deliveries = inflight_count(entry)
            if deliveries > 1 then
                record = string.sub(record, 1, -2) .. ',"n":' .. deliveries .. "}"
            end
            put_run(root, mid, attempt, job, status, tenant, origin, score ~= "" and score or now, record,
                completed_ttl, failed_ttl, now, owned[i] and deliveries <= 1, vouched == "1")
            indexed_job = indexed_job or job
        end
        local value = nil
        if root and at and extra(i, 7) ~= "" then
            -- the end of a job that keeps results: its value (a completed run), then the
            -- announcement its waiters wake on (a completed or dead one)
            local kept, announced, ttl = extra(i, 7), origin, nil
            if kept ~= "-" then
                ttl, value = string.match(kept, "^(%d+) (.*)$")
                if not ttl then
                    error("kumiko: malformed result " .. string.sub(kept, 1, 40))
                end
                if ttl ~= "0" then
                    redis.call("set", root .. "result:" .. origin, value, "PX", ttl)
                end
                if #value <= 8192 then -- a small value travels with it: no read per waiter
                    announced = origin .. "\t" .. job .. "\t" .. value
                end
            end
            if ttl ~= "0" then
                redis.call("publish", root .. "results", announced)
            end
        end
        if root and at and extra(i, 8) ~= "" and (status == "completed" or status == "dead"
            or status == "cancelled") then
            local kind, batch = string.match(extra(i, 8), "^([bc]) (.+)$")
            if kind == "c" then
                batch_callback_ended(root, batch, mid)
            elseif kind == "b" then
                local error_type, error_message = nil, nil
                if status ~= "completed" then
                    local run = cjson.decode(ARGV[base + 8])
                    error_type, error_message = run.et, run.em
                end
                batch_child_ended(root, batch, batch_member(origin, tenant), status,
                    batch_head(status, job, tenant ~= "" and tenant or nil, error_type,
                        error_message), value, now, true)
            else
                error("kumiko: malformed batch end " .. string.sub(extra(i, 8), 1, 60))
            end
        end
        if mine then
            results[i] = 1
            if outcome ~= "completed" and ARGV[base + 2] ~= "" then
                redis.call("set", ARGV[base + 2], "1", "PX", tombstone_ttl)
            end
            if owned[i] then
                acked[#acked + 1] = rid
            else
                redis.call("lrem", recovered[i], 0, rid)
            end
            if outcome == "dead" then
                -- each dead letter of the batch a millisecond apart, in order: listings page
                -- the dead letters by time
                now = head_now + dead_count
                dead_count = dead_count + 1
                dead_letter(rid)
                now = head_now
                if root and at and extra(i, 2) ~= "" then
                    redis.call("set", root .. "dead:" .. mid, extra(i, 2), "PX", dead_ttl)
                end
            else
                forgotten[#forgotten + 1] = rid
                forgotten_actors[#forgotten] = ARGV[base + 9]
            end
        else
            results[i] = 0
        end
    end
end
for i = 1, count do
    local ended = dedup_ends[i]
    if ended and not deferred[i] then
        redis.call("del", ended[1])
        redis.call("zrem", ended[2], ended[3])
    end
end
if #out_of_flight > 0 then
    redis.call("hdel", KEYS[2], unpack(out_of_flight))
end
if #acked > 0 then
    redis.call("srem", queue_acks, unpack(acked))
end
forget_bodies(queue_messages, forgotten, forgotten_actors)
flush_runs()
-- the batch ends counted above, one write per counter and batch (a callback they enqueue may
-- be claimed below)
batch_flush(root_of_runs, now)
if tonumber(trim) > 0 then
    if root_of_runs ~= "" then
        trim_runs(root_of_runs, tonumber(cap), tonumber(trim), completed_ttl, failed_ttl, now,
            indexed_job)
    end
end
local claimed, now_given = nil, 0
if claiming then
    claimed, now_given = claim_lane(ARGV[claim_at], ARGV[claim_at + 1], ARGV[claim_at + 2],
        ARGV[claim_at + 3], ARGV[claim_at + 4], released)
end
if hold_reply then
    return {results, claimed or {}, now_given, hold_reply}
end
if not claiming then
    return results
end
return {results, claimed}
