-- include "dedup": a dispatch under a dedup key, the producer's one decision.
-- dedup_dispatch(messages, list, rid, body, record, index, key, ttl_ms, id, payload, trigger)
--   -> {1|0, id}
--   messages, list  the queue's message hash and list   rid, body  the message to enqueue
--   record  the key's record (a hash: id, state queued|running|ending, follow-up fid,
--           fpayload, ftrigger)   index, key  the job's index of live records
--           (include/dedup_index.lua) and the dedup key   ttl_ms  its TTL
--   id  this message's id
--   payload  the payload (JSON)   trigger  this dispatch's trigger
-- no record: write {id, queued} with its TTL (and its index entry) and enqueue -> {1, id}.
-- running: the first trigger allocates the follow-up id (its own), every trigger replaces
--   its payload and trigger -> {0, follow-up id}.
-- ending with a follow-up -> {0, follow-up id}. queued (or anything else) -> {0, live id}.
-- A trigger never extends the TTL.
-- @include enqueue
-- @include dedup_index
local function dedup_dispatch(messages, list, rid, body, record, index, key, ttl, id, payload,
                              trigger)
    local live = redis.call("hmget", record, "id", "state", "fid")
    if not live[1] then
        redis.call("del", record)
        enqueue_message(messages, list, rid, body)
        redis.call("hset", record, "id", id, "state", "queued")
        redis.call("pexpire", record, ttl)
        index_dedup(index, key, ttl, true)
        return {1, id}
    end
    if live[2] == "running" then
        local fid = live[3] or id
        redis.call("hset", record, "fid", fid, "fpayload", payload, "ftrigger", trigger)
        return {0, fid}
    end
    if live[2] == "ending" and live[3] then
        return {0, live[3]}
    end
    return {0, live[1]}
end
