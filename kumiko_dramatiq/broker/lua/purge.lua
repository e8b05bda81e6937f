-- purge: drop every message of a queue, its dead letters and this worker's claims on it (and
-- kumiko's note of the ids cancel withdrew from it, "<queue list>:withdrawn"; a delay queue's
-- schedule, "<queue list>:schedule"; its order, include/route.lua).
-- KEYS[1] namespace
-- ARGV[1..2] dispatch head (see include/dispatch.lua)
-- Returns nothing.
-- @include dispatch
-- @include route
route_clear(queue_list)
uncount_all(queue_messages)
redis.call("del", queue_list, queue_acks, queue_messages, dead_letters, dead_bodies,
    queue_list .. ":withdrawn", queue_list .. ":schedule")
