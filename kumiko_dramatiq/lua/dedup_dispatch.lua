-- dedup_dispatch: a dispatch under a dedup key (the producer's one decision).
-- KEYS[1] queue messages hash   KEYS[2] queue list   KEYS[3] the key's record (a hash:
--   id, state queued|running|ending, follow-up fid, fpayload, ftrigger)
-- ARGV[1] redis message id   ARGV[2] encoded message   ARGV[3] record TTL (ms)
-- ARGV[4] this message's id   ARGV[5] payload (JSON)   ARGV[6] trigger
-- Returns {1, id} (enqueued) or {0, the id the key stands for}:
-- no record: write {id, queued} with its TTL and enqueue -> {1, id}.
-- running: the first trigger allocates the follow-up id (its own), every trigger replaces
--   its payload and trigger -> {0, follow-up id}.
-- ending with a follow-up -> {0, follow-up id}. queued (or anything else) -> {0, live id}.
-- A trigger never extends the TTL.
-- @include enqueue
-- @include ttl
ttl_ms(ARGV[3], "dedup record")
local record = KEYS[3]
local live = redis.call("hmget", record, "id", "state", "fid")
if not live[1] then
    redis.call("del", record)
    enqueue_message(KEYS[1], KEYS[2], ARGV[1], ARGV[2])
    redis.call("hset", record, "id", ARGV[4], "state", "queued")
    redis.call("pexpire", record, ARGV[3])
    return {1, ARGV[4]}
end
if live[2] == "running" then
    local fid = live[3] or ARGV[4]
    redis.call("hset", record, "fid", fid, "fpayload", ARGV[5], "ftrigger", ARGV[6])
    return {0, fid}
end
if live[2] == "ending" and live[3] then
    return {0, live[3]}
end
return {0, live[1]}
