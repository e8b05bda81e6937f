-- cron_tick: enqueue one cron tick exactly once, however many schedulers run.
-- KEYS[1] queue messages hash   KEYS[2] queue list   KEYS[3] the tick's guard
-- KEYS[4] the job's last-tick record   KEYS[5] the paused code schedules (keys.schedules_paused)
-- ARGV[1] redis message id   ARGV[2] encoded message   ARGV[3] guard TTL (ms)
-- ARGV[4] guard value (the scheduler's identity)   ARGV[5] tick (UTC epoch seconds)
-- ARGV[6] last-tick record TTL (ms)   ARGV[7] the job (its schedule's id)
-- Enqueues iff the guard did not exist and the job's schedule is not paused; raises the
-- last-tick record to the tick either way (never lowers it: a resumed schedule does not
-- catch up the ticks of its pause) and refreshes its TTL. Returns {1} (enqueued), {0} (enqueued
-- before) or {2} (paused).
-- @include guarded
ttl_ms(ARGV[3], "tick guard")
ttl_ms(ARGV[6], "last-tick record")
local enqueued = 2
if redis.call("sismember", KEYS[5], ARGV[7]) == 0 then
    enqueued =
        enqueue_unless_guarded(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[3], ARGV[4], ARGV[3])
end
local last = tonumber(redis.call("get", KEYS[4]))
if last == nil or last < tonumber(ARGV[5]) then
    redis.call("set", KEYS[4], ARGV[5], "PX", ARGV[6])
else
    redis.call("pexpire", KEYS[4], ARGV[6])
end
return {enqueued}
