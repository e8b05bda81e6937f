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

-- put_run(root, message id, attempt, job, status, tenant or "", origin id, at ms, record,
--         TTL ms of this status, the longest TTL of any status)
local function put_run(root, mid, attempt, job, status, tenant, origin, at, record, ttl, long_ttl)
    local hash = root .. "run:" .. mid
    local member = mid .. ":" .. attempt
    local old = redis.call("hget", hash, attempt)
    if old then
        local was = string.match(old, '"s":"(%a+)"')
        if was and was ~= status then
            redis.call("zrem", run_job_index(root, job, was), member)
            redis.call("zrem", run_status_index(root, was), member)
        end
    end
    redis.call("hset", hash, attempt, record)
    if redis.call("pttl", hash) < ttl then
        redis.call("pexpire", hash, ttl)
    end
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
