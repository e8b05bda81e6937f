-- include "enqueue": write one message exactly as Dramatiq's Redis broker lays it out, and
-- ring the queue's doorbell unless the queue holds a backlog (see include/bell.lua); a delayed
-- one goes on its queue's schedule.
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
-- write_message(messages, list, rid, body): Dramatiq's write, whatever the queue (the
--   "enqueue" command, Dramatiq's own, uses it).
-- push_message(messages, list, rid, body): the rest of write_message once the body is in
--   `messages`: its count, its id on the list (a body with a route: in the queue's order,
--   include/route.lua), the doorbell.
-- @include bell
-- @include counts
-- @include route
local function schedule_message(messages, list, rid, delay_ms, body, counted)
    local time = redis.call("time")
    local due = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + delay_ms
    local schedule = list .. ":schedule"
    redis.call("hset", messages, rid, body)
    count_body(messages, rid, body, 1, counted)
    redis.call("zadd", schedule, due, rid)
    if redis.call("zrange", schedule, 0, 0)[1] == rid then
        ring(list)
    end
end

-- A message written to a queue that holds at most RING_UNTIL messages with it rings the
-- doorbell (a token taken by a consumer that then stops without fetching is made good by the
-- next message); a backlog's enqueues ring nothing, one command each less: its consumers are
-- busy or woken already, a fetch that leaves messages behind rings for the next consumer
-- (fetch_lane), and an idle consumer's wait is the backstop.
local RING_UNTIL = 16

local function push_message(messages, list, rid, body, counted)
    count_body(messages, rid, body, 1, counted)
    local level, key = route_of(body)
    local length
    if level and string.sub(list, -3) ~= ".DQ" then
        length = route_push(list, rid, level, key)
    else
        length = redis.call("rpush", list, rid)
    end
    if length <= RING_UNTIL then
        ring(list)
    end
end

local function write_message(messages, list, rid, body, counted)
    redis.call("hset", messages, rid, body)
    push_message(messages, list, rid, body, counted)
end

local function enqueue_message(messages, list, rid, body, counted)
    if string.sub(list, -3) == ".DQ" then
        local delay_ms = string.match(string.sub(body, 1, 24), "^(%d+) ")
        if delay_ms then
            schedule_message(messages, list, rid, tonumber(delay_ms),
                string.sub(body, #delay_ms + 2), counted)
            return
        end
    end
    write_message(messages, list, rid, body, counted)
end
