-- enqueue: Dramatiq's enqueue, made idempotent per redis message id.
-- KEYS[1] namespace   KEYS[2] (optional) the "sent" marker of this redis message id
-- ARGV[1..6] dispatch head (see _dispatch.lua)
-- ARGV[7] redis message id   ARGV[8] encoded message   ARGV[9] (with KEYS[2]) marker TTL (ms)
-- Returns 1 (written) or 0 (the marker exists: the same write was made before; a re-sent
-- command after a dropped connection, or a second move of the same delayed message).
-- @include dispatch
-- @include enqueue
if KEYS[2] then
    if redis.call("exists", KEYS[2]) == 1 then
        return 0
    end
end
enqueue_message(queue_messages, queue_list, ARGV[7], ARGV[8])
if KEYS[2] then
    redis.call("set", KEYS[2], "1", "PX", ARGV[9])
end
return 1
