-- schedule_fire: enqueue one tick of a runtime schedule exactly once, however many schedulers
-- run (an enqueue step: KEYS[1..2] and ARGV[1..2] the message, KumikoBroker.enqueue_step).
-- KEYS[3] the due ones (keys.schedules_due)   KEYS[4] the last ticks (keys.schedules_last)
-- KEYS[5] the tick's guard   KEYS[6] the schedule's dedup record (its job's, key
-- "schedule:<id>")   KEYS[7] the job's index of live dedup records   KEYS[8] the skipped
-- ticks by job (keys.cron_skipped)
-- ARGV[3] the schedule's id   ARGV[4] its due score as the caller read it (ms)
-- ARGV[5] its next tick after this one (ms)   ARGV[6] the tick enqueued now (ms; "" for none:
-- every due tick was a misfire to skip)   ARGV[7] guard and dedup record TTL (ms)
-- ARGV[8] guard value (the scheduler's identity)   ARGV[9] overlap ("allow", "skip",
-- "buffer_one")   ARGV[10] the message's id   ARGV[11] its payload (JSON)   ARGV[12] its job
-- Only while the schedule's score is still ARGV[4] (not paused, removed, changed or fired by
-- another scheduler since): its score moves to the next tick and its last tick is recorded;
-- then "allow" enqueues unless the tick's guard is there; "skip" enqueues under the dedup
-- key unless a run of the schedule is queued or running (its record exists); "buffer_one"
-- goes by the dedup key's rules (include/dedup.lua: queued -> this tick is coalesced into it,
-- running -> this tick is its one follow-up). A skipped tick is counted for its job.
-- Returns {0} (not due any more: nothing done), {1} (enqueued), {2} (skipped: a run is queued
-- or running), {3} (the tick waits behind the running one) or {4} (only moved on).
-- @include guarded
-- @include dedup
local due, last = KEYS[3], KEYS[4]
local id = ARGV[3]
local score = redis.call("zscore", due, id)
if not score or tonumber(score) ~= tonumber(ARGV[4]) then
    return {0}
end
ttl_ms(ARGV[7], "schedule tick guard")
redis.call("zadd", due, ARGV[5], id)
if ARGV[6] == "" then
    return {4}
end
redis.call("hset", last, id, ARGV[6])
local overlap = ARGV[9]
if overlap == "allow" then
    return {enqueue_unless_guarded(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[5], ARGV[8],
        ARGV[7])}
end
if overlap == "skip" and redis.call("exists", KEYS[6]) == 1 then
    redis.call("hincrby", KEYS[8], ARGV[12], 1)
    return {2}
end
local reply = dedup_dispatch(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[6], KEYS[7],
    "schedule:" .. id, ARGV[7], ARGV[10], ARGV[11], "cron")
if reply[1] == 1 then
    return {1}
elseif reply[2] == ARGV[10] then
    return {3}
end
redis.call("hincrby", KEYS[8], ARGV[12], 1)
return {2}
