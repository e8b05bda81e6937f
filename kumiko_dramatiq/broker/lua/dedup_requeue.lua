-- dedup_requeue: the keyed job lives on in a message that is queued again.
-- KEYS[1] the key's record   KEYS[2] the job's index of live records
-- (include/dedup_index.lua)
-- ARGV[1] message id   ARGV[2] the next live id (a retry: the same id; a sequential
--   hand-off: the hand-off's id)   ARGV[3] record TTL (ms)   ARGV[4] the dedup key
-- Iff the record points at ARGV[1]: point it at ARGV[2], state queued, TTL refreshed (its
-- index entry too); a pending follow-up stays. Returns 1 or 0.
-- @include dedup_index
if redis.call("hget", KEYS[1], "id") ~= ARGV[1] then
    return 0
end
redis.call("hset", KEYS[1], "id", ARGV[2], "state", "queued")
redis.call("pexpire", KEYS[1], ARGV[3])
index_dedup(KEYS[2], ARGV[4], ARGV[3], false)
return 1
