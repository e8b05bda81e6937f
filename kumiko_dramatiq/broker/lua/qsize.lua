-- qsize: messages of a queue and its delay queue, queued or claimed by this worker.
-- KEYS[1] namespace
-- ARGV[1..2] dispatch head (see include/dispatch.lua); ".DQ" on the queue name is ignored
-- Returns hlen(queue.msgs) + scard(own acks) + the same for the delay queue.
-- @include dispatch
local base = namespace .. ":" .. canonical
local base_acks = namespace .. ":__acks__." .. worker .. "." .. canonical
return redis.call("hlen", base .. ".msgs") + redis.call("scard", base_acks)
    + redis.call("hlen", base .. ".DQ.msgs") + redis.call("scard", base_acks .. ".DQ")
