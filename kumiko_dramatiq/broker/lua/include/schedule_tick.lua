-- include "schedule_tick": one tick of a runtime schedule, fired exactly once however many
-- schedulers run (lua/schedule_fire_batch.lua).
-- fire_tick(messages, list, rid, body, t) -> 0 (not due any more: nothing done), 1 (enqueued),
--   2 (skipped: a run is queued or running), 3 (the tick waits behind the running one) or 4
--   (only moved on); t: {due (keys.schedules_due), last (keys.schedules_last), guard (the
--   tick's), record (the schedule's dedup record: key "schedule:<id>"), index (the job's
--   live dedup records), skipped (keys.cron_skipped), id, score (its due score as the caller
--   read it), next (its next tick after this one), tick (the tick enqueued now, "" for none:
--   every due tick was a misfire to skip), ttl (guard and dedup record TTL), guard_value,
--   overlap, message_id, payload (JSON), job}
-- Only while the schedule's score is still t.score (not paused, removed, changed or fired by
-- another scheduler since): its score moves to t.next and its last tick is recorded; then
-- "allow" enqueues unless the tick's guard is there; "skip" enqueues under the dedup key unless
-- a run of the schedule is queued or running (its record exists); "buffer_one" goes by the
-- dedup key's rules (include/dedup.lua: queued -> coalesced into it, running -> its one
-- follow-up). A skipped tick is counted for its job.
-- @include guarded
-- @include dedup

local function fire_tick(messages, list, rid, body, t)
    local score = redis.call("zscore", t.due, t.id)
    if not score or tonumber(score) ~= tonumber(t.score) then
        return 0
    end
    redis.call("zadd", t.due, t.next, t.id)
    if t.tick == "" then
        return 4
    end
    redis.call("hset", t.last, t.id, t.tick)
    if t.overlap == "allow" then
        return enqueue_unless_guarded(messages, list, rid, body, t.guard, t.guard_value, t.ttl)
    end
    if t.overlap == "skip" and redis.call("exists", t.record) == 1 then
        redis.call("hincrby", t.skipped, t.job, 1)
        return 2
    end
    local reply = dedup_dispatch(messages, list, rid, body, t.record, t.index,
        "schedule:" .. t.id, t.ttl, t.message_id, t.payload, "cron")
    if reply[1] == 1 then
        return 1
    elseif reply[2] == t.message_id then
        return 3
    end
    redis.call("hincrby", t.skipped, t.job, 1)
    return 2
end
