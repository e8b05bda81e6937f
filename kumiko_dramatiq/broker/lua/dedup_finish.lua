-- dedup_finish: the keyed job ended for good.
-- KEYS[1] the key's record   KEYS[2] the job's index of live records
-- (include/dedup_index.lua)
-- ARGV[1] message id   ARGV[2] record TTL (ms)   ARGV[3] the dedup key
-- Returns, iff the record points at this message: without a follow-up delete it (and its
-- index entry) -> {"freed"}; with one, freeze it as "ending" -> {"follow-up", fid, fpayload,
-- ftrigger}. Else {"gone"}.
-- @include dedup_index
local rec = redis.call("hmget", KEYS[1], "id", "fid", "fpayload", "ftrigger")
if rec[1] ~= ARGV[1] then
    return {"gone"}
end
if not rec[2] then
    redis.call("del", KEYS[1])
    unindex_dedup(KEYS[2], ARGV[3])
    return {"freed"}
end
redis.call("hset", KEYS[1], "state", "ending")
redis.call("pexpire", KEYS[1], ARGV[2])
index_dedup(KEYS[2], ARGV[3], ARGV[2], false)
return {"follow-up", rec[2], rec[3], rec[4]}
