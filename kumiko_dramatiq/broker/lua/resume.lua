-- resume: a paused job runs again; its held-back messages go back to the head of its queue,
-- a bounded step at a time.
-- KEYS[1] the set of paused jobs   KEYS[2] the job's parked list   KEYS[3] the queue's list
-- KEYS[4] the queue's message hash   KEYS[5] the job's withdrawn parked ids (cancelled while
-- parked: keys.parked_withdrawn)
-- ARGV[1] the job   ARGV[2] kumiko root "kumiko:<prefix>:"   ARGV[3] now (ms)
-- ARGV[4] TTL (ms) of cancelled run records   ARGV[5] TTL (ms) of failed ones
-- ARGV[6] at most this many parked ids this step
-- ARGV[7..] redis ids of parked messages to drop instead (cron ticks its misfire policy skips)
-- The job leaves the paused set. Up to ARGV[6] ids leave the parked list from its tail (the
-- last parked first) for the head of the queue, so once the list is empty they wait ahead of
-- what was queued meanwhile, in their parked order; except the ids to drop, whose messages
-- are deleted and whose run record (if any) says "cancelled", and ids whose message was
-- cancelled while parked (no body), which are dropped without a word. Once the parked list
-- is empty its withdrawn set goes too. The queue's doorbell rings if any went back.
-- Returns {1 if the job was paused, requeued, dropped, parked ids left}.
-- @include history
-- @include batch
-- @include bell
-- @include counts
local drop = {}
for i = 7, #ARGV do
    drop[ARGV[i]] = true
end
local was_paused = redis.call("srem", KEYS[1], ARGV[1])
local step = redis.call("rpop", KEYS[2], tonumber(ARGV[6])) or {}
local requeued, dropped = 0, 0
for _, rid in ipairs(step) do
    local body = redis.call("hget", KEYS[4], rid)
    if not body then
        redis.call("srem", KEYS[5], rid)
    elseif drop[rid] then
        local run = run_of(ARGV[2], body, "")
        if run then
            run.s, run.en, run.em = "cancelled", tonumber(ARGV[3]), "skipped on resume (misfire)"
            put_run(ARGV[2], run.m, run.a, run.j, "cancelled", run.t or "", run.o,
                run.q or tonumber(ARGV[3]), cjson.encode(run), tonumber(ARGV[4]),
                tonumber(ARGV[5]), tonumber(ARGV[3]))
            batch_run_ended(ARGV[2], run, "cancelled", tonumber(ARGV[3]))
        end
        uncount(KEYS[4], rid)
        redis.call("hdel", KEYS[4], rid)
        dropped = dropped + 1
    else
        redis.call("lpush", KEYS[3], rid)
        requeued = requeued + 1
    end
end
flush_runs()
local left = redis.call("llen", KEYS[2])
if left == 0 then
    redis.call("del", KEYS[5])
end
if requeued > 0 then
    ring(KEYS[3])
end
return {was_paused, requeued, dropped, left}
