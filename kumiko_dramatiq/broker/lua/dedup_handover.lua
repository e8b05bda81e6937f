-- dedup_handover: enqueue the follow-up of an ended keyed job and make it the live job.
-- KEYS[1] queue messages hash   KEYS[2] queue list   KEYS[3] the key's record
-- KEYS[4] the job's index of live records (include/dedup_index.lua)
-- ARGV[1] redis message id   ARGV[2] encoded follow-up   ARGV[3] the ended message's id
-- ARGV[4] the follow-up's id   ARGV[5] record TTL (ms)   ARGV[6] the dedup key
-- Iff the record is still ARGV[3]'s "ending" with follow-up ARGV[4]: enqueue it, record
-- {id = ARGV[4], queued} (its index entry follows). Returns {1} or {0}.
-- @include enqueue
-- @include ttl
-- @include dedup_index
ttl_ms(ARGV[5], "dedup record")
local rec = redis.call("hmget", KEYS[3], "id", "state", "fid")
if rec[1] ~= ARGV[3] or rec[2] ~= "ending" or rec[3] ~= ARGV[4] then
    return {0}
end
enqueue_message(KEYS[1], KEYS[2], ARGV[1], ARGV[2])
redis.call("del", KEYS[3])
redis.call("hset", KEYS[3], "id", ARGV[4], "state", "queued")
redis.call("pexpire", KEYS[3], ARGV[5])
index_dedup(KEYS[4], ARGV[6], ARGV[5], false)
return {1}
