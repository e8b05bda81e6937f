-- include "cancelling": what every way of taking a message out of the system before it ran
-- shares (cancel.lua, purge_step.lua, a held message dropped or taken over: include/holds.lua).
-- forget_body(messages, rid): delete rid's body from message hash `messages`, uncounted
-- free_dedup(root, job, message): the dedup key the decoded `message` (of `job`) holds is freed,
--   if its record still points at the message (and leaves its job's index)
-- record_cancelled(root, body, now, completed_ttl, failed_ttl): the run record of the message
--   `body` (if kumiko wrote it) says "cancelled" at now
-- @include counts
-- @include dedup_index
-- @include history
-- @include batch

local function forget_body(messages, rid)
    uncount(messages, rid)
    redis.call("hdel", messages, rid)
end

local function free_dedup(root, job, message)
    local key = message.options.kumiko_dedup_key
    if type(key) == "string" then
        local record = root .. "dedup:" .. job .. ":" .. key
        if redis.call("hget", record, "id") == message.message_id then
            redis.call("del", record)
            unindex_dedup(root .. "dedupidx:" .. job, key)
        end
    end
end

local function record_cancelled(root, body, now, completed_ttl, failed_ttl)
    local run = run_of(root, body, "")
    if run then
        run.s, run.en, run.w = "cancelled", now, nil
        put_run(root, run.m, run.a, run.j, "cancelled", run.t or "", run.o, run.q or now,
            cjson.encode(run), completed_ttl, failed_ttl, now)
        flush_runs()
        batch_run_ended(root, run, "cancelled", now)
    end
end
