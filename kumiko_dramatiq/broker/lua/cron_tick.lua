-- cron_tick: enqueue one cron tick exactly once, however many schedulers run.
-- KEYS[1] queue messages hash   KEYS[2] queue list   KEYS[3] the tick's guard
-- KEYS[4] the job's last-tick record   KEYS[5] the paused code schedules (keys.schedules_paused)
-- KEYS[6] the schedule's dedup record (the job's, key "schedule:<job>")   KEYS[7] the job's
-- index of live dedup records   KEYS[8] the skipped ticks by job (keys.cron_skipped)
-- ARGV[1] redis message id   ARGV[2] encoded message   ARGV[3] guard TTL (ms)
-- ARGV[4] guard value (the scheduler's identity)   ARGV[5] tick (UTC epoch seconds)
-- ARGV[6] last-tick record TTL (ms)   ARGV[7] the job (its schedule's id)
-- ARGV[8] the Cron's overlap ("allow", "skip", "buffer_one")   ARGV[9] the message's id
-- ARGV[10] its payload (JSON)
-- Once per tick (its guard, SET NX, decides) and unless the job's schedule is paused: "allow"
-- enqueues; "skip" enqueues under the schedule's dedup key unless a run of it is queued or
-- running; "buffer_one" goes by the dedup key's rules (include/dedup.lua: queued -> this tick
-- is coalesced into it, running -> it is the one follow-up). A skipped tick is counted for the
-- job. Raises the last-tick record to the tick either way (never lowers it: a resumed
-- schedule does not catch up the ticks of its pause) and refreshes its TTL.
-- Returns {1} (enqueued), {0} (enqueued before), {2} (paused), {3} (skipped) or {4} (waits
-- behind the running one).
-- @include guarded
-- @include dedup
ttl_ms(ARGV[3], "tick guard")
ttl_ms(ARGV[6], "last-tick record")
local enqueued = 2
local overlap = ARGV[8]
if redis.call("sismember", KEYS[5], ARGV[7]) == 1 then
    enqueued = 2
elseif overlap == "allow" then
    enqueued =
        enqueue_unless_guarded(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[3], ARGV[4], ARGV[3])
elseif not redis.call("set", KEYS[3], ARGV[4], "NX", "PX", ARGV[3]) then
    enqueued = 0
elseif overlap == "skip" and redis.call("exists", KEYS[6]) == 1 then
    enqueued = 3
else
    local reply = dedup_dispatch(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[6], KEYS[7],
        "schedule:" .. ARGV[7], ARGV[3], ARGV[9], ARGV[10], "cron")
    if reply[1] == 1 then
        enqueued = 1
    elseif reply[2] == ARGV[9] then
        enqueued = 4
    else
        enqueued = 3
    end
end
if enqueued == 3 then
    redis.call("hincrby", KEYS[8], ARGV[7], 1)
end
local last = tonumber(redis.call("get", KEYS[4]))
if last == nil or last < tonumber(ARGV[5]) then
    redis.call("set", KEYS[4], ARGV[5], "PX", ARGV[6])
else
    redis.call("pexpire", KEYS[4], ARGV[6])
end
return {enqueued}
