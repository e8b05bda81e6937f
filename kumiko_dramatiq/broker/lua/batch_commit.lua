-- batch_commit: open a written batch or chain (every child written: they may start now) and
-- move up to ARGV[4] of its staged children onto their queues (include/batch.lua).
-- KEYS[1] the batch hash "<root>batch:<id>"   KEYS[2] (with an idempotency key) the key's
-- record "<root>idem:batch:<key>" or "<root>idem:chain:<key>" (the first dispatch's id)
-- ARGV[1] kumiko root "kumiko:<prefix>:"   ARGV[2] the batch id   ARGV[3] now (ms)
-- ARGV[4] how many staged children to move at most   ARGV[5] the record's TTL (ms; with
-- KEYS[2])
-- With a key, the batch opens only if the record holds no other id: the first writer to
-- open wins; another's staged batch is never opened and expires (nothing of it runs), and
-- {"taken", 0, the first id} comes back. A writer that dies before opening leaves no record.
-- A chain opens whole: its steps' records are kept, its first step opens; later steps open
-- as the one before succeeds. Calling it again moves the next children (a writer repeats it
-- until none is left; the ends of moved children move the rest if the writer stops).
-- Returns {state, staged children left} ({"gone", 0}: no such batch, or it expired unopened).
-- @include batch
local key, root, id, now = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local record = KEYS[2]
if record then
    local first = redis.call("get", record)
    if first and first ~= id then
        return {"taken", 0, first}
    end
end
local head = redis.call("hmget", key, "kind", "state", "steps", "ns", "created")
if not head[1] then
    return {"gone", 0}
end
if record and head[2] == "writing" then
    redis.call("set", record, id, "PX", ARGV[5])
end
local moving = key
if head[1] == "chain" then
    local steps = tonumber(head[3])
    if head[2] == "writing" then
        local total = 0
        for step = 1, steps do
            local step_key = key .. "." .. step
            total = total + redis.call("llen", step_key .. ":children")
            for _, each in ipairs({step_key, step_key .. ":children", step_key .. ":staged"}) do
                redis.call("persist", each)
            end
        end
        redis.call("hset", key, "state", "running", "total", total, "pending", total,
            "completed", 0, "dead", 0, "cancelled", 0, "started", now, "step", 1)
        redis.call("persist", key)
        redis.call("zadd", root .. "batches", head[5], id)
        batch_open(key .. ".1", now)
    end
    moving = key .. "." .. (redis.call("hget", key, "step") or "1")
elseif head[2] == "writing" then
    batch_open(key, now)
    redis.call("zadd", root .. "batches", head[5], id)
end
local left = batch_move(moving, head[4], limit)
return {redis.call("hget", key, "state"), left}
