-- cancel: make sure a message that has not started never starts.
-- KEYS[1] namespace
-- ARGV[1] kumiko root "kumiko:<prefix>:"   ARGV[2] the message id (or the id a sequential
-- hand-off carries on as its origin)   ARGV[3] now (ms)   ARGV[4] TTL (ms) of completed and
-- cancelled run records   ARGV[5] TTL (ms) of failed ones   ARGV[6] how long past its due
-- time a delayed message held in a worker's memory may still be moved (ms)
-- ARGV[7..] the lane queues to look in
-- Looks for the message in each lane queue and its delay queue (their message hashes). Not
-- found: {0, "gone"}. Claimed from a lane queue by a live worker (in a worker's ack set:
-- kumiko workers fetch only what their threads start, so it runs): {0, "running"}, nothing
-- changed. Waiting (in the queue list, the suspects list, a paused job's parked list, or the
-- delay queue list): removed. Held in a worker's memory, waiting to come due: the cancel
-- marker "<root>cancel:<message id>" is set until it is due plus ARGV[6], and its move drops
-- it. Either way its run record says "cancelled" and a dedup key it held is freed.
-- Returns {1, queue, redis id} (cancelled) or {0, reason}.
-- @include history
local namespace, root, wanted = KEYS[1], ARGV[1], ARGV[2]
local now = tonumber(ARGV[3])

-- the decoded message with this id (or a hand-off carrying it on), if body is one
local function matches(body)
    if not string.find(body, wanted, 1, true) then
        return nil
    end
    local ok, message = pcall(cjson.decode, body)
    if not ok or type(message) ~= "table" or type(message.options) ~= "table" then
        return nil
    end
    if message.message_id == wanted then
        return message
    end
    local options = message.options
    if options.kumiko_origin_id == wanted and options.kumiko_trigger == "requeue" then
        return message
    end
    return nil
end

-- {redis id, body, decoded} of the message in a queue's hash, or nil
local function find(messages)
    local cursor = "0"
    repeat
        local page = redis.call("hscan", messages, cursor, "COUNT", 1000)
        cursor = page[1]
        local entries = page[2]
        for i = 1, #entries, 2 do
            local message = matches(entries[i + 1])
            if message then
                return {entries[i], entries[i + 1], message}
            end
        end
    until cursor == "0"
    return nil
end

-- whether any worker has the redis id in its ack set of the queue
local function claimed(queue, rid)
    local workers = redis.call("zrange", namespace .. ":__heartbeats__", 0, -1)
    for _, worker in ipairs(workers) do
        if redis.call("sismember", namespace .. ":__acks__." .. worker .. "." .. queue, rid) == 1
        then
            return true
        end
    end
    return false
end

for i = 7, #ARGV do
    for _, queue in ipairs({ARGV[i], ARGV[i] .. ".DQ"}) do
        local list = namespace .. ":" .. queue
        local hit = find(list .. ".msgs")
        if hit then
            local rid, body, message = hit[1], hit[2], hit[3]
            local delayed = string.sub(queue, -3) == ".DQ"
            local waiting = redis.call("lrem", list, 1, rid) == 1
            if not waiting and not delayed then
                waiting = redis.call("lrem", root .. "suspects:" .. queue, 1, rid) == 1
            end
            local job = string.gsub(message.actor_name or "", ":fanout$", "")
            if not waiting and not delayed then
                waiting = redis.call("lrem", root .. "parked:" .. job, 1, rid) == 1
            end
            if not waiting then
                if not delayed or not claimed(queue, rid) then
                    return {0, "running"}
                end
                -- held in a worker's memory until due: its move drops it
                local due = tonumber(message.options.eta) or now
                local ttl = math.max(due - now, 0) + tonumber(ARGV[6])
                redis.call("set", root .. "cancel:" .. message.message_id, "1", "PX", ttl)
            else
                redis.call("hdel", list .. ".msgs", rid)
                redis.call("hdel", root .. "inflight", rid)
            end
            local run = run_of(root, body, "")
            if run then
                run.s, run.en, run.w = "cancelled", now, nil
                put_run(root, run.m, run.a, run.j, "cancelled", run.t or "", run.o, now,
                    cjson.encode(run), tonumber(ARGV[4]), tonumber(ARGV[5]))
            end
            local key = message.options.kumiko_dedup_key
            if type(key) == "string" then
                local record = root .. "dedup:" .. job .. ":" .. key
                if redis.call("hget", record, "id") == message.message_id then
                    redis.call("del", record)
                end
            end
            return {1, queue, rid}
        end
    end
end
return {0, "gone"}
