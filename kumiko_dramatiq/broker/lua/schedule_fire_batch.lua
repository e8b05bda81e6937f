-- schedule_fire_batch: the ticks of many runtime schedules of one queue, each exactly once
-- (KumikoBroker.enqueue_batch: KEYS[1..2] the queue's hash and list).
-- ARGV[1] the due ones (keys.schedules_due)   ARGV[2] the last ticks (keys.schedules_last)
-- ARGV[3] the skipped ticks by job (keys.cron_skipped)   ARGV[4] guard and dedup record TTL
-- (ms)   ARGV[5] guard value (the scheduler's identity)
-- then per tick, thirteen arguments: the schedule's id, redis message id, encoded message, its
-- due score as the caller read it, its next tick, the tick enqueued now ("" for none), overlap,
-- the message's id, its payload (JSON), its job, the tick's guard, the schedule's dedup record,
-- the job's index of live dedup records
-- Each is fired as include/schedule_tick.lua fires it. Returns one code per tick, in order:
-- 0 (not due any more: nothing done), 1 (enqueued), 2 (skipped: a run is queued or running),
-- 3 (the tick waits behind the running one) or 4 (only moved on).
-- @include schedule_tick
ttl_ms(ARGV[4], "schedule tick guard")
local fired = {}
for i = 6, #ARGV, 13 do
    fired[#fired + 1] = fire_tick(KEYS[1], KEYS[2], ARGV[i + 1], ARGV[i + 2], {
        due = ARGV[1], last = ARGV[2], skipped = ARGV[3], ttl = ARGV[4], guard_value = ARGV[5],
        id = ARGV[i], score = ARGV[i + 3], next = ARGV[i + 4], tick = ARGV[i + 5],
        overlap = ARGV[i + 6], message_id = ARGV[i + 7], payload = ARGV[i + 8],
        job = ARGV[i + 9], guard = ARGV[i + 10], record = ARGV[i + 11], index = ARGV[i + 12],
    })
end
return fired
