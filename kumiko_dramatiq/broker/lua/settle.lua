-- settle: the outcome of one delivery from a kumiko lane queue, in one step.
-- KEYS[1] namespace   KEYS[2] in-flight hash (see fetch_lane)   KEYS[3] "already completed"
-- marker of the message id (written only for outcome "completed")   KEYS[4] the queue's
-- suspects list (see fetch_lane)
-- ARGV[1..2] dispatch head (see include/dispatch.lua)
-- ARGV[3] redis message id   ARGV[4] "<outcome> <marker TTL ms>", outcome "ack" |
--         "completed" | "retry" (a failed attempt's retry, or a sequential hand-off) | "dead"
-- ARGV[5] the run record's header, tab-separated, or "" for none: kumiko root
--         "kumiko:<prefix>:", message id, attempt, job, status, tenant ("" = none), origin id,
--         TTL ms of completed and cancelled records, TTL ms of failed ones, record cap, trim
--         budget (0, or how many records beyond the cap to drop now: about every 32nd call,
--         see trim_runs). Status "" writes no record (a sequential hand-off: no attempt
--         happened); "malformed": the message is dead-lettered unrun, and if its body reads
--         as kumiko's, its attempt's record says "dead" with the reason ARGV[6]
-- ARGV[6] the run record (JSON)   ARGV[7] the dead letter's note (JSON, outcome "dead"; "" =
--         none), kept as long as dead letters
-- ARGV[8] retry queue (a delay queue if delayed)   ARGV[9] retry redis id   ARGV[10] the
--         encoded retry (outcome "retry" only)
-- Writes the run record (with the deliveries count when more than one); then, iff the
-- delivery is this worker's: removes its in-flight entry; "ack" and "completed" forget the
-- message, "retry" forgets it and enqueues its retry or hand-off (so a crash can neither
-- lose it nor enqueue it twice; it is written first, so a write that fails leaves the
-- delivery untouched), "dead" moves it to the dead letters with its note. A delivery no
-- longer in this worker's ack set was recovered by maintenance while the worker was presumed
-- dead: if its recovered copy still waits (in the queue or the suspects list), the copy is
-- taken back and the delivery settled as if it had stayed this worker's, so no second copy
-- of a settled message is left to run; if another worker took the copy already, only the
-- marker and the record are written (the in-flight entry is that worker's now): it runs
-- there too (at least once).
-- Returns 1 if the delivery was (or became again) this worker's, else 0.
-- @include dispatch
-- @include enqueue
-- @include dead_letter
-- @include ttl
-- @include history
local rid = ARGV[3]
local outcome, marker_ttl = string.match(ARGV[4], "^(%a+) (%d+)$")
if outcome == "completed" then
    ttl_ms(marker_ttl, "completed marker")
end
local root, mid, attempt, job, status, tenant, origin, completed_ttl, failed_ttl, cap, trim
if ARGV[5] ~= "" then
    root, mid, attempt, job, status, tenant, origin, completed_ttl, failed_ttl, cap, trim =
        string.match(ARGV[5], "^([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t"
            .. "([^\t]*)\t([^\t]*)\t(%d+)\t(%d+)\t(%d+)\t(%d+)$")
    ttl_ms(completed_ttl, "completed run record")
    ttl_ms(failed_ttl, "failed run record")
    completed_ttl, failed_ttl = tonumber(completed_ttl), tonumber(failed_ttl)
end
-- Whose delivery is it? Read first: nothing is written before the follow-up, the one write
-- that can fail on a key it does not own (a failed settle then leaves the delivery as it was).
local owned = redis.call("sismember", queue_acks, rid) == 1
local recovered = nil
if not owned then
    if redis.call("lpos", queue_list, rid) then
        recovered = queue_list
    elseif redis.call("lpos", KEYS[4], rid) then
        recovered = KEYS[4]
    end
end
local mine = owned or recovered ~= nil
if mine and outcome == "retry" then
    local retry_list = namespace .. ":" .. ARGV[8]
    enqueue_message(retry_list .. ".msgs", retry_list, ARGV[9], ARGV[10])
end
local entry = nil
if mine then
    entry = redis.call("hget", KEYS[2], rid)
    redis.call("hdel", KEYS[2], rid)
end
if outcome == "completed" then
    redis.call("set", KEYS[3], "1", "PX", marker_ttl)
end
if root then
    if status == "malformed" then
        local claimed_by = entry and string.match(entry, "^%d+|%d+|(.+)$")
        local run = run_of(root, redis.call("hget", queue_messages, rid), claimed_by or worker)
        if run then
            run.s, run.en, run.et, run.em = "dead", now, "MalformedMessage", ARGV[6]
            if inflight_count(entry) > 1 then
                run.n = inflight_count(entry)
            end
            put_run(root, run.m, run.a, run.j, "dead", run.t or "", run.o, now,
                cjson.encode(run), completed_ttl, failed_ttl)
        end
    elseif status ~= "" then
        local record = ARGV[6]
        local deliveries = inflight_count(entry)
        if deliveries > 1 then
            record = string.sub(record, 1, -2) .. ',"n":' .. deliveries .. "}"
        end
        put_run(root, mid, attempt, job, status, tenant, origin, now, record, completed_ttl,
            failed_ttl)
    end
    if tonumber(trim) > 0 then
        local indexed_job = nil
        if status ~= "" and status ~= "malformed" then
            indexed_job = job
        end
        trim_runs(root, tonumber(cap), tonumber(trim), completed_ttl, failed_ttl, now,
            indexed_job)
    end
end
if not mine then
    return 0
end
if owned then
    redis.call("srem", queue_acks, rid)
else
    redis.call("lrem", recovered, 0, rid)
end
if outcome == "dead" then
    dead_letter(rid)
    if root and ARGV[7] ~= "" then
        redis.call("set", root .. "dead:" .. mid, ARGV[7], "PX", dead_ttl)
    end
    return 1
end
uncount(queue_messages, rid)
redis.call("hdel", queue_messages, rid)
return 1
