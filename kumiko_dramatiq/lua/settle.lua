-- settle: the outcome of one delivery from a kumiko lane queue, in one step.
-- KEYS[1] namespace   KEYS[2] deliveries hash   KEYS[3] "already completed" marker of the
-- message id (written only for outcome "completed")
-- ARGV[1..6] dispatch head (see _dispatch.lua)
-- ARGV[7] redis message id   ARGV[8] outcome: "ack" | "completed" | "retry" | "dead"
-- ARGV[9] marker TTL (ms)
-- ARGV[10] retry queue (a delay queue if delayed; "" without a retry)   ARGV[11] retry redis
-- id   ARGV[12] encoded retry
-- ARGV[13] run history root "kumiko:<prefix>:" ("" = no run record)   ARGV[14] message id
-- ARGV[15] attempt   ARGV[16] job   ARGV[17] the run's status, or "" to drop its running
-- record (a sequential hand-off: no attempt happened), or "malformed": the message is
-- dead-lettered unrun, its record (if its body reads as kumiko's, as the fetch wrote it)
-- ends "dead" with the reason ARGV[20] (ARGV[14..16], [18], [19] unused)   ARGV[18] tenant
-- ARGV[19] origin id   ARGV[20] the run record (JSON)   ARGV[21] TTL (ms) of completed and
-- cancelled records   ARGV[22] TTL (ms) of running, failed and dead ones   ARGV[23] record cap
-- ARGV[24] the dead letter's note (JSON, outcome "dead"; "" = none), kept as long as dead
-- letters (ARGV[5])
-- Clears the delivery's count and writes the run record; then, iff the id is still in this
-- worker's ack set: "ack" and "completed" forget the message, "retry" forgets it and
-- enqueues its retry (so a crash can neither lose the retry nor enqueue it twice), "dead"
-- moves it to the dead letters with its note. A delivery no longer this worker's (recovered
-- by maintenance while the worker was presumed dead) changes nothing but the count, the
-- marker and the record: it runs again where it was recovered to.
-- Returns 1 if the delivery was this worker's, else 0.
-- @include dispatch
-- @include enqueue
-- @include dead_letter
-- @include ttl
-- @include history
local rid, outcome = ARGV[7], ARGV[8]
if outcome == "completed" then
    ttl_ms(ARGV[9], "completed marker")
end
local root = ARGV[13]
if root ~= "" then
    ttl_ms(ARGV[21], "completed run record")
    ttl_ms(ARGV[22], "failed run record")
end
redis.call("hdel", KEYS[2], rid)
if outcome == "completed" then
    redis.call("set", KEYS[3], "1", "PX", ARGV[9])
end
if root ~= "" then
    local mid, attempt, job, status = ARGV[14], ARGV[15], ARGV[16], ARGV[17]
    if status == "" then
        drop_run(root, mid .. ":" .. attempt, "running")
        redis.call("zrem", run_job_index(root, job, "running"), mid .. ":" .. attempt)
    elseif status == "malformed" then
        local run = run_of(root, redis.call("hget", queue_messages, rid), worker)
        if run then
            run.s, run.en, run.et, run.em = "dead", now, "MalformedMessage", ARGV[20]
            put_run(root, run.m, run.a, run.j, "dead", run.t or "", run.o, now,
                cjson.encode(run), tonumber(ARGV[21]), tonumber(ARGV[22]))
        end
    else
        put_run(root, mid, attempt, job, status, ARGV[18], ARGV[19], now, ARGV[20],
            tonumber(ARGV[21]), tonumber(ARGV[22]))
        trim_runs(root, tonumber(ARGV[23]))
    end
end
if redis.call("srem", queue_acks, rid) == 0 then
    return 0
end
if outcome == "dead" then
    dead_letter(rid)
    if root ~= "" and ARGV[24] ~= "" then
        redis.call("set", root .. "dead:" .. ARGV[14], ARGV[24], "PX", ARGV[5])
    end
    return 1
end
redis.call("hdel", queue_messages, rid)
if outcome == "retry" then
    local retry_list = namespace .. ":" .. ARGV[10]
    enqueue_message(retry_list .. ".msgs", retry_list, ARGV[11], ARGV[12])
end
return 1
