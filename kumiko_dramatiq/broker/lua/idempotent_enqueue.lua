-- idempotent_enqueue: a dispatch with an idempotency key: the message, unless the key was
-- used within its TTL (then the first dispatch's id, nothing written).
-- KEYS[1] queue messages hash   KEYS[2] queue list   KEYS[3] the "sent" key (guard, as
-- guarded_enqueue's)   KEYS[4] the queue's counts hash   KEYS[5] the key's record
-- "<root>idem:<job>:<key>" (the first dispatch's message id)
-- ARGV[1] redis message id   ARGV[2] encoded message   ARGV[3] guard TTL (ms), or "0"
-- (include/guarded.lua)   ARGV[4] guard value   ARGV[5] the message's counts field
-- ARGV[6] message id   ARGV[7] the record's TTL (ms: idempotency_ttl_s)
-- Returns {1, message id} (enqueued, the record set) or {0, the first dispatch's id}.
-- @include guarded
local first = redis.call("get", KEYS[5])
if first then
    return {0, first}
end
ttl_ms(ARGV[7], "idempotency record")
enqueue_unless_guarded(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[3], ARGV[4], ARGV[3],
    {KEYS[4], ARGV[5]})
redis.call("set", KEYS[5], ARGV[6], "PX", ARGV[7])
return {1, ARGV[6]}
