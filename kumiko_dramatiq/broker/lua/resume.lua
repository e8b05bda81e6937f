-- resume: a paused job runs again; its held-back messages go back to the head of its queue.
-- KEYS[1] the set of paused jobs   KEYS[2] the job's parked list   KEYS[3] the queue's list
-- KEYS[4] the queue's message hash
-- ARGV[1] the job   ARGV[2] kumiko root "kumiko:<prefix>:"   ARGV[3] now (ms)
-- ARGV[4] TTL (ms) of cancelled run records   ARGV[5] TTL (ms) of failed ones
-- ARGV[6..] redis ids of parked messages to drop instead (cron ticks its misfire policy skips)
-- The job leaves the paused set; each parked id goes back to the queue, ahead of what was
-- queued meanwhile and in its parked order, except the ids to drop, whose messages are
-- deleted and whose run record (if any) says "cancelled". The queue's doorbell rings if any
-- went back.
-- Returns {requeued, dropped}.
-- @include history
-- @include bell
local drop = {}
for i = 6, #ARGV do
    drop[ARGV[i]] = true
end
redis.call("srem", KEYS[1], ARGV[1])
local parked = redis.call("lrange", KEYS[2], 0, -1)
redis.call("del", KEYS[2])
local requeued, dropped = 0, 0
for i = #parked, 1, -1 do
    local rid = parked[i]
    if drop[rid] then
        local run = run_of(ARGV[2], redis.call("hget", KEYS[4], rid), "")
        if run then
            run.s, run.en, run.em = "cancelled", tonumber(ARGV[3]), "skipped on resume (misfire)"
            put_run(ARGV[2], run.m, run.a, run.j, "cancelled", run.t or "", run.o,
                tonumber(ARGV[3]), cjson.encode(run), tonumber(ARGV[4]), tonumber(ARGV[5]))
        end
        redis.call("hdel", KEYS[4], rid)
        dropped = dropped + 1
    else
        redis.call("lpush", KEYS[3], rid)
        requeued = requeued + 1
    end
end
if requeued > 0 then
    ring(KEYS[3])
end
return {requeued, dropped}
