-- include "history": write and trim run records (format: kumiko_dramatiq/history.py).
-- Keys, all under the dataset's root "kumiko:<prefix>:" (passed as `root`):
--   run:<message id>                   hash attempt -> record (JSON), TTL = its longest status age
--   runs:job:<job>:<status>            zset "<message id>:<attempt>" by time of the last write
--   runs:status:<status>               zset, the same members across jobs
--   runs:tenant:<tenant>               zset, records of a tenant (TTL refreshed on write)
--   runs:origin:<origin id>            zset, records of messages whose origin is another id
-- Index entries older than their status age are trimmed on every write to that index.

local RUN_STATUSES = {"running", "completed", "failed", "dead", "cancelled"}

local function run_job_index(root, job, status)
    return root .. "runs:job:" .. job .. ":" .. status
end

local function run_status_index(root, status)
    return root .. "runs:status:" .. status
end

local function index_run(index, at, member, ttl)
    redis.call("zadd", index, at, member)
    redis.call("zremrangebyscore", index, "-inf", "(" .. (at - ttl))
end

-- How long a record of `status` lives: completed and cancelled ones `completed_ttl` ms,
-- running, failed and dead ones `failed_ttl` ms.
local function run_ttl(status, completed_ttl, failed_ttl)
    if status == "completed" or status == "cancelled" then
        return completed_ttl
    end
    return failed_ttl
end

-- put_run(root, message id, attempt, job, status, tenant or "", origin id, at ms, record,
--         completed TTL ms, failed TTL ms)
-- The run hash lives as long as the longest-lived of its records.
local function put_run(root, mid, attempt, job, status, tenant, origin, at, record,
                       completed_ttl, failed_ttl)
    local hash = root .. "run:" .. mid
    local member = mid .. ":" .. attempt
    local ttl = run_ttl(status, completed_ttl, failed_ttl)
    local long_ttl = math.max(completed_ttl, failed_ttl)
    local old = redis.call("hget", hash, attempt)
    if old then
        local was = string.match(old, '"s":"(%a+)"')
        if was and was ~= status then
            redis.call("zrem", run_job_index(root, job, was), member)
            redis.call("zrem", run_status_index(root, was), member)
        end
        -- the end record keeps the deliveries count its running record had
        local deliveries = string.match(old, '"n":(%d+)')
        if deliveries and not string.find(record, '"n":', 1, true) then
            record = string.sub(record, 1, -2) .. ',"n":' .. deliveries .. "}"
        end
    end
    redis.call("hset", hash, attempt, record)
    local keep = ttl
    local others = redis.call("hgetall", hash)
    for i = 1, #others, 2 do
        if others[i] ~= tostring(attempt) then
            local other = string.match(others[i + 1], '"s":"(%a+)"')
            keep = math.max(keep, run_ttl(other or "failed", completed_ttl, failed_ttl))
        end
    end
    redis.call("pexpire", hash, keep)
    index_run(run_job_index(root, job, status), at, member, ttl)
    index_run(run_status_index(root, status), at, member, ttl)
    local extra = {}
    if tenant ~= "" then
        extra[#extra + 1] = root .. "runs:tenant:" .. tenant
    end
    if origin ~= mid then
        extra[#extra + 1] = root .. "runs:origin:" .. origin
    end
    for _, index in ipairs(extra) do
        index_run(index, at, member, long_ttl)
        if redis.call("pttl", index) < long_ttl then
            redis.call("pexpire", index, long_ttl)
        end
    end
end

-- drop_run(root, member, status): forget one record and its index entries.
local function drop_run(root, member, status)
    local mid, attempt = string.match(member, "^(.*):(%d+)$")
    redis.call("zrem", run_status_index(root, status), member)
    if not mid then
        return
    end
    local hash = root .. "run:" .. mid
    local record = redis.call("hget", hash, attempt)
    redis.call("hdel", hash, attempt)
    if not record then
        return
    end
    local ok, run = pcall(cjson.decode, record)
    if not ok or type(run) ~= "table" then
        return
    end
    if type(run.j) == "string" then
        redis.call("zrem", run_job_index(root, run.j, status), member)
    end
    if type(run.t) == "string" then
        redis.call("zrem", root .. "runs:tenant:" .. run.t, member)
    end
    if type(run.o) == "string" then
        redis.call("zrem", root .. "runs:origin:" .. run.o, member)
    end
end

-- trim_runs(root, cap): while more than `cap` records are indexed, drop the oldest records,
-- completed first, then cancelled, failed and dead (never running ones); at most 4 per call,
-- so a lowered cap is reached over the next writes, never in one long call.
local function trim_runs(root, cap)
    local total = 0
    for _, status in ipairs(RUN_STATUSES) do
        total = total + redis.call("zcard", run_status_index(root, status))
    end
    local budget = math.min(total - cap, 4)
    for _, status in ipairs({"completed", "cancelled", "failed", "dead"}) do
        while budget > 0 do
            local oldest = redis.call("zrange", run_status_index(root, status), 0, 0)[1]
            if not oldest then
                break
            end
            drop_run(root, oldest, status)
            budget = budget - 1
        end
    end
end

-- run_of(root, body, worker): the run record fields of an encoded message kumiko wrote (its
-- attempt from its options), or nil for anything else (or when root is "": no history).
local function run_of(root, body, worker)
    if root == "" or not body then
        return nil
    end
    local ok, message = pcall(cjson.decode, body)
    if not ok or type(message) ~= "table" or type(message.options) ~= "table" then
        return nil
    end
    local options = message.options
    if type(options.kumiko_trigger) ~= "string" or type(message.actor_name) ~= "string"
        or type(message.message_id) ~= "string" then
        return nil
    end
    local job = string.gsub(message.actor_name, ":fanout$", "")
    local function text(value)
        if type(value) == "string" then
            return value
        end
        return nil
    end
    return {
        j = job, m = message.message_id, o = text(options.kumiko_origin_id) or message.message_id,
        t = text(options.kumiko_tenant_id), tr = options.kumiko_trigger,
        a = (tonumber(options.kumiko_failures) or 0) + 1,
        ma = (tonumber(options.kumiko_retries) or 0) + 1,
        q = tonumber(message.message_timestamp), w = worker,
        sa = text(options.kumiko_scheduled_at), dk = text(options.kumiko_dedup_key),
    }
end
