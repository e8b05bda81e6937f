-- settle: the outcome of one delivery from a kumiko lane queue, in one step.
-- KEYS[1] namespace   KEYS[2] deliveries hash   KEYS[3] "already completed" marker of the
-- message id (written only for outcome "completed")
-- ARGV[1..6] dispatch head (see _dispatch.lua)
-- ARGV[7] redis message id   ARGV[8] outcome: "ack" | "completed" | "retry" | "dead"
-- ARGV[9] marker TTL (ms)
-- ARGV[10] retry queue (a delay queue if delayed)   ARGV[11] retry redis id
-- ARGV[12] encoded retry (outcome "retry" only)
-- Clears the delivery's count; then, iff the id is still in this worker's ack set: "ack" and
-- "completed" forget the message, "retry" forgets it and enqueues its retry (so a crash can
-- neither lose the retry nor enqueue it twice), "dead" moves it to the dead letters. A
-- delivery no longer this worker's (recovered by maintenance while the worker was presumed
-- dead) changes nothing but the marker: it runs again where it was recovered to.
-- Returns 1 if the delivery was this worker's, else 0.
-- @include dispatch
-- @include enqueue
-- @include dead_letter
-- @include ttl
if ARGV[8] == "completed" then
    ttl_ms(ARGV[9], "completed marker")
end
local rid, outcome = ARGV[7], ARGV[8]
redis.call("hdel", KEYS[2], rid)
if outcome == "completed" then
    redis.call("set", KEYS[3], "1", "PX", ARGV[9])
end
if redis.call("srem", queue_acks, rid) == 0 then
    return 0
end
if outcome == "dead" then
    dead_letter(rid)
    return 1
end
redis.call("hdel", queue_messages, rid)
if outcome == "retry" then
    local retry_list = namespace .. ":" .. ARGV[10]
    enqueue_message(retry_list .. ".msgs", retry_list, ARGV[11], ARGV[12])
end
return 1
