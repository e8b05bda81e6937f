-- schedule_legacy: messages on Dramatiq's own delay queue list (written by an older kumiko or
-- a plain RedisBroker, before an upgrade or by old workers during a rolling deploy) go onto
-- the queue's schedule (keys.queue_schedule), a bounded batch in one step.
-- KEYS[1] namespace
-- ARGV[1..2] dispatch head (see include/dispatch.lua), ARGV[1] = the delay queue
-- ARGV[3..] triples: redis id, due time (ms), the message in the form it takes on its queue
--           (no "eta"; the caller read the list's head and re-encoded each one)
-- Each id still within the first 1,000 entries of the delay queue's list leaves the list; if
-- its body is still there (a cancel deletes it) the body is replaced by the given form and
-- the id joins the schedule at its due time. An id no longer in the list (an old worker
-- fetched it meanwhile, and moves it itself) is left alone. One script: a kill neither loses
-- a message nor schedules it twice. The delay queue's doorbell rings if any was scheduled.
-- Returns how many ids it took off the list (scheduled, or dropped for want of a body).
-- @include dispatch
-- @include bell
local schedule = queue_list .. ":schedule"
local scheduled, taken = 0, 0
for i = 3, #ARGV, 3 do
    local rid = ARGV[i]
    if redis.call("lpos", queue_list, rid, "MAXLEN", 1000) then
        redis.call("lrem", queue_list, 1, rid)
        taken = taken + 1
        if redis.call("hexists", queue_messages, rid) == 1 then
            redis.call("hset", queue_messages, rid, ARGV[i + 2])
            redis.call("zadd", schedule, tonumber(ARGV[i + 1]), rid)
            scheduled = scheduled + 1
        end
    end
end
if scheduled > 0 then
    ring(queue_list)
end
return taken
