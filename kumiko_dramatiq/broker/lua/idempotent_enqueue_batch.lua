-- idempotent_enqueue_batch: dispatch_many with idempotency keys: each message of ONE queue
-- unless its key was used within its TTL (a key given twice in the call stands for its
-- first message), in one call.
-- KEYS[1] queue messages hash   KEYS[2] queue list
-- ARGV[1] guard TTL (ms), or "0" (include/guarded.lua)   ARGV[2] guard value   ARGV[3] the
-- records' TTL (ms)   ARGV[4] the kumiko root "kumiko:<prefix>:"
-- then per message: its "sent" key, its redis id, its encoded message, its key's record,
-- its message id
-- Returns per message {1, its id} (enqueued) or {0, the first dispatch's id}.
-- @include guarded
ttl_ms(ARGV[3], "idempotency record")
local replies = {}
for i = 5, #ARGV, 5 do
    local record, mid = ARGV[i + 3], ARGV[i + 4]
    local first = redis.call("get", record)
    if first then
        replies[#replies + 1], replies[#replies + 2] = 0, first
    else
        enqueue_unless_guarded(KEYS[1], KEYS[2], ARGV[i + 1], ARGV[i + 2], ARGV[i], ARGV[2],
            ARGV[1])
        redis.call("set", record, mid, "PX", ARGV[3])
        replies[#replies + 1], replies[#replies + 2] = 1, mid
    end
end
return replies
