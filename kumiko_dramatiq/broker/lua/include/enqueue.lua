-- include "enqueue": write one message exactly as Dramatiq's Redis broker lays it out, and
-- ring the queue's doorbell (see include/bell.lua); a delayed one goes on its queue's schedule.
-- enqueue_message(messages, list, rid, body)
--   messages  <namespace>:<queue>.msgs, hash redis message id -> encoded message
--   list      <namespace>:<queue>, list of redis message ids (consumers pop from the left)
--   A delayed message (list <namespace>:<queue>.DQ) comes as "<delay ms> <encoded message>",
--   the message already in the form it takes on <queue> (no "eta"; see
--   KumikoBroker.encode): its body goes in the delay queue's hash and its id on the schedule
--   "<namespace>:<queue>.DQ:schedule" (keys.queue_schedule), scored by its due time, Redis's
--   clock (TIME) plus the delay; the delay queue's doorbell rings if it is the earliest, so
--   a mover sleeping until a later due time wakes (lua/move.lua moves it when due). A body
--   for a delay queue in Dramatiq's own form (JSON, "{..."; nothing of kumiko's writes one)
--   goes on Dramatiq's list as Dramatiq writes it (lua/schedule_legacy.lua moves it later).
-- @include bell
local function schedule_message(messages, list, rid, delay_ms, body)
    local time = redis.call("time")
    local due = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + delay_ms
    local schedule = list .. ":schedule"
    redis.call("hset", messages, rid, body)
    redis.call("zadd", schedule, due, rid)
    if redis.call("zrange", schedule, 0, 0)[1] == rid then
        ring(list)
    end
end

local function enqueue_message(messages, list, rid, body)
    if string.sub(list, -3) == ".DQ" and string.byte(body, 1) ~= 123 then
        local space = string.find(body, " ", 1, true)
        local delay_ms = space and tonumber(string.sub(body, 1, space - 1))
        if not delay_ms or delay_ms < 0 then
            error("kumiko: malformed delayed message for " .. list)
        end
        schedule_message(messages, list, rid, delay_ms, string.sub(body, space + 1))
        return
    end
    redis.call("hset", messages, rid, body)
    redis.call("rpush", list, rid)
    ring(list)
end
