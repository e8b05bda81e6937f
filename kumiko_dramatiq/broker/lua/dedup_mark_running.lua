-- dedup_mark_running: a worker starts the job a dedup key stands for.
-- KEYS[1] the key's record
-- ARGV[1] message id   ARGV[2] record TTL (ms)
-- Iff the record points at this message: state running, TTL refreshed. Returns 1 or 0.
if redis.call("hget", KEYS[1], "id") ~= ARGV[1] then
    return 0
end
redis.call("hset", KEYS[1], "state", "running")
redis.call("pexpire", KEYS[1], ARGV[2])
return 1
