-- dedup_debounce: a dispatch under a dedup key with debounce (include/dedup.lua's decision, and
-- while the keyed job has not started: the last payload wins and its start moves back).
-- KEYS[1] the delay queue's messages hash   KEYS[2] the delay queue's list (its schedule is
-- "<list>:schedule", keys.queue_schedule)   KEYS[3] the key's record   KEYS[4] the job's index
-- of live records (include/dedup_index.lua)
-- ARGV[1] redis message id   ARGV[2] "<debounce ms> <encoded message>"   ARGV[3] record TTL
-- (ms)   ARGV[4] this message's id   ARGV[5] payload (JSON)   ARGV[6] trigger   ARGV[7] the
-- dedup key   ARGV[8] the max wait (ms; "" for none)
-- No record: the message is written, due in debounce ms, and the record {id, queued, deadline
-- (the first dispatch + the max wait, Redis's clock; absent without a max wait)} -> {1, id}.
-- The record of a message still waiting on the schedule: built under its id (ARGV[4] is the
-- record's), its body is replaced by this one and it is due again at now + debounce, never
-- later than the deadline, the record's TTL renewed -> {1, id}; built under another id ->
-- {2, the live id} (the caller builds it again under that id: its redis id is derived from
-- it). Anything else (moved onto its queue, running, ending): include/dedup.lua's rules ->
-- {0, id}.
-- Returns {1, id} (written, or the live message replaced), {2, live id} (build it again under
-- that id) or {0, the id the key stands for}.
-- @include dedup
-- @include ttl
ttl_ms(ARGV[3], "dedup record")
local messages, list, record, index = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local rid, body, ttl, id, key = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[7]
local live = redis.call("hmget", record, "id", "state", "deadline")
if not live[1] then
    local reply = dedup_dispatch(messages, list, rid, body, record, index, key, ttl, id,
        ARGV[5], ARGV[6])
    if ARGV[8] ~= "" then
        redis.call("hset", record, "deadline",
            string.format("%d", dedup_clock_ms() + tonumber(ARGV[8])))
    end
    return reply
end
if live[2] == "queued" then
    if id ~= live[1] then
        return {2, live[1]}
    end
    local schedule = list .. ":schedule"
    if redis.call("zscore", schedule, rid) then
        local delay_ms = string.match(string.sub(body, 1, 24), "^(%d+) ")
        if not delay_ms then
            error("kumiko: malformed debounced message")
        end
        local due = dedup_clock_ms() + tonumber(delay_ms)
        if live[3] then
            due = math.min(due, tonumber(live[3]))
        end
        redis.call("hset", messages, rid, string.sub(body, #delay_ms + 2))
        redis.call("zadd", schedule, string.format("%d", due), rid)
        if redis.call("zrange", schedule, 0, 0)[1] == rid then
            ring(list)
        end
        redis.call("pexpire", record, ttl)
        index_dedup(index, key, ttl, false)
        return {1, id}
    end
    return {0, id}
end
return dedup_dispatch(messages, list, rid, body, record, index, key, ttl, id, ARGV[5], ARGV[6])
