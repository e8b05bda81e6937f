-- dedup_mark_running: a worker starts the job a dedup key stands for.
-- KEYS[1] the key's record   KEYS[2] the job's index of live records
-- (include/dedup_index.lua)
-- ARGV[1] message id   ARGV[2] record TTL (ms)   ARGV[3] the dedup key
-- Iff the record points at this message: state running, TTL refreshed (its index entry
-- too). Returns 1 or 0.
-- @include dedup_index
if redis.call("hget", KEYS[1], "id") ~= ARGV[1] then
    return 0
end
redis.call("hset", KEYS[1], "state", "running")
redis.call("pexpire", KEYS[1], ARGV[2])
index_dedup(KEYS[2], ARGV[3], ARGV[2], false)
return 1
