-- include "enqueue": write one message exactly as Dramatiq's Redis broker lays it out, and
-- ring the queue's doorbell (see include/bell.lua).
-- enqueue_message(messages, list, rid, body)
--   messages  <namespace>:<queue>.msgs, hash redis message id -> encoded message
--   list      <namespace>:<queue>, list of redis message ids (consumers pop from the left)
-- @include bell
-- @include counts
local function enqueue_message(messages, list, rid, body)
    redis.call("hset", messages, rid, body)
    count_body(messages, rid, body, 1)
    redis.call("rpush", list, rid)
    ring(list)
end
