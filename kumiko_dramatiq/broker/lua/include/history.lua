-- include "history": run records (format: kumiko_dramatiq/history.py).
-- Keys, all under the dataset's root "kumiko:<prefix>:" (passed as `root`):
--   run:<message id>          hash attempt -> the record of an attempt that ended (JSON);
--                             TTL = the longest status age of its records (running runs are
--                             read off the in-flight hash "<root>inflight", see fetch_lane)
--   runs:job:<job>:<status>   zset "<message id>:<attempt>" (the run id) by the attempt's
--                             start in ms (its enqueue time if it never started)
--   runs:status:<status>      zset, the same members across jobs
--   runs:tenant:<tenant>      zset, records of a tenant
--   runs:origin:<origin id>   zset, records of messages whose origin is another id
--                             (an index's TTL is the longest record age plus INDEX_TTL_SLACK_MS,
--                             refreshed on each write, so an index of a job or tenant gone
--                             quiet expires; a job's and a status's index only when the writer
--                             has not vouched for it, see put_run)
--   stats:<job>:<hour>        hash, per-job counters of the hour (see put_run)
-- trim_runs drops index entries older than their status age and records beyond the cap; the
-- writers call it on about one write in 32, so its cost is shared.
-- @include group
-- @include body

local RUN_STATUSES = {"running", "completed", "failed", "dead", "cancelled"}

local function run_job_index(root, job, status)
    return root .. "runs:job:" .. job .. ":" .. status
end

local function run_status_index(root, status)
    return root .. "runs:status:" .. status
end

-- cache_of(cache, a, b): the table cache[a][b], made on first use. The keys a script call builds
-- for every record (index keys, stats keys) are built once per call and looked up after: a Lua
-- string costs Redis's Lua about 12 instructions a byte and a concatenation about 1,000 more, a
-- table lookup about 100.
local function cache_of(cache, a, b)
    local level = cache[a]
    if not level then
        level = {}
        cache[a] = level
    end
    local found = level[b]
    if not found then
        found = {}
        level[b] = found
    end
    return found
end

-- record_indexes(root, job, status): {job index, status index} of a record (index_keys[root][job]
-- [status], once per call)
-- @per-call
local index_keys = {}
-- @end per-call
local function record_indexes(root, job, status)
    local of_job = cache_of(index_keys, root, job)
    local found = of_job[status]
    if not found then
        found = {run_job_index(root, job, status), run_status_index(root, status)}
        of_job[status] = found
    end
    return found
end

-- How long a record of `status` lives: completed and cancelled ones `completed_ttl` ms,
-- running, failed and dead ones `failed_ttl` ms.
local function run_ttl(status, completed_ttl, failed_ttl)
    if status == "completed" or status == "cancelled" then
        return completed_ttl
    end
    return failed_ttl
end

-- Index entries and per-job stats are gathered while a script runs and written once at its
-- end by flush_runs() (one ZADD per index and one HINCRBY per stats field for a whole batch of
-- records; the indexes to refresh the TTL of in pending_index_refresh): every script that
-- calls put_run calls flush_runs() before it returns.
-- @per-call
local pending_index, pending_index_keys, pending_index_refresh = {}, {}, {}
local pending_stats, pending_stats_keys = {}, {}
local pending_index_ttl = 0
-- @end per-call

-- Numbers handed to redis.call are formatted by Redis 7.0 with printf("%.17g"), and Lua's own
-- concatenation of a number uses printf too: both cost more than the command they feed. So
-- the integers these writes pass (scores, TTLs, counts, hours) go as text, each distinct one
-- formatted once per script call ("%d": no floating-point formatting).
-- @per-call
local int_texts = {}
-- @end per-call
local function int_text(n)
    if type(n) ~= "number" or n % 1 ~= 0 then
        return n
    end
    local text = int_texts[n]
    if not text then
        text = string.format("%d", n)
        int_texts[n] = text
    end
    return text
end

-- How much longer than its longest-lived record an index lives: a writer that vouches for an
-- index (put_run) refreshed its TTL less than a minute ago, so the index still outlives every
-- record written since.
local INDEX_TTL_SLACK_MS = 120000

-- index_add(index, score as text, member, ttl, vouched): vouched = the writer refreshed this
-- index's TTL within the last minute (its own refresh is then skipped)
local function index_add(index, score, member, ttl, vouched)
    group_add(pending_index, pending_index_keys, index, score, member)
    if not vouched then
        pending_index_refresh[index] = true
    end
    if ttl > pending_index_ttl then
        pending_index_ttl = ttl
    end
end

-- Per-job stats (kumiko_dramatiq/ops/stats.py reads them): hash "<root>stats:<job>:<hour>"
-- (hours since the epoch, by the attempt's end), fields "failed", "dead", "cancelled"
-- (attempts), "c<bucket>" (completed attempts by duration: bucket d for d < 64 ms, else 64 +
-- floor(log(d / 64) / log(1.1)), so a bucket spans 10%) and "completed" (completed attempts
-- with no duration); kept 8 days. A completed attempt is one count, in one field: the
-- completed attempts of an hour are "completed" plus every "c<bucket>" (a writer before this
-- layout counted each in "completed" and in "b<bucket>": the reader adds those as they are).
local STATS_TTL_MS = "691200000" -- 8 days
local STATS_BUCKETS_EXACT = 64
local LOG_STEP = 0.09531017980432493 -- math.log(1.1) (a library may not call math at load)

local function duration_bucket(d)
    if d < STATS_BUCKETS_EXACT then
        return d
    end
    return STATS_BUCKETS_EXACT + math.floor(math.log(d / STATS_BUCKETS_EXACT) / LOG_STEP)
end

-- duration_field(record): the stats field of a completed record's duration ("c<bucket>"), or
-- nil if it has none: its first "d" field with digits, found by plain search (a pattern search
-- over the whole record costs more than all of the record's writes)
local function duration_field(record)
    local from = 1
    while true do
        local at = string.find(record, '"d":', from, true)
        if not at then
            return nil
        end
        local digits = string.match(record, "^%d+", at + 4)
        if digits then
            if #digits == 1 or (#digits == 2 and digits < "64" and string.sub(digits, 1, 1) ~= "0") then
                return "c" .. digits
            end
            return "c" .. int_text(duration_bucket(tonumber(digits)))
        end
        from = at + 1
    end
end

-- stats_hash(root, job, now): the stats hash of job's hour of `now` (ms), each built once per
-- call (stats_keys[hour][root][job])
-- @per-call
local stats_hours, stats_keys = {}, {}
-- @end per-call
local function stats_hash(root, job, now)
    local hour = stats_hours[now]
    if not hour then
        hour = int_text(math.floor(now / 3600000))
        stats_hours[now] = hour
    end
    local of_root = cache_of(stats_keys, hour, root)
    local hash = of_root[job]
    if not hash then
        hash = root .. "stats:" .. job .. ":" .. hour
        of_root[job] = hash
    end
    return hash
end

local function stat_add(hash, field)
    local fields = pending_stats[hash]
    if not fields then
        fields = {}
        pending_stats[hash] = fields
        pending_stats_keys[#pending_stats_keys + 1] = hash
    end
    fields[field] = (fields[field] or 0) + 1
end

-- put_run(root, message id, attempt, job, status, tenant or "", origin id, score, record,
--         completed TTL ms, failed TTL ms, now ms, sole writer, vouched)
-- sole writer: true when no other step can have written this attempt's record with another
-- status (the settle of a delivery still this worker's, delivered once): the old record is
-- then not read; HSET's reply says whether the record is new, and only if it is not are its
-- other statuses' index entries looked for.
-- score: the attempt's start in ms (its enqueue time if it never started): the indexes order
-- records by it, then by member (the run id "<message id>:<attempt>"). The run hash lives as
-- long as the longest-lived of its records: an attempt after the first follows a failed one,
-- so its hash keeps at least the failed TTL. Writing the same record again (a settle retried
-- after a lost reply) changes nothing and counts nothing twice in the stats.
-- vouched: the writer refreshed the TTLs of the job's and the status's index of this record
-- (job, status) less than a minute ago (the settles of one process, see settle.lua's head):
-- they are not refreshed again; a tenant's or an origin's index always is.
local function put_run(root, mid, attempt, job, status, tenant, origin, score, record,
                       completed_ttl, failed_ttl, now, sole_writer, vouched)
    local hash = root .. "run:" .. mid
    local member = mid .. ":" .. attempt
    local fresh = true
    if sole_writer then
        if redis.call("hset", hash, attempt, record) == 0 then
            -- written before (rare): drop its entries under another status, if any
            fresh = false
            for _, was in ipairs(RUN_STATUSES) do
                if was ~= status and redis.call("zrem", run_status_index(root, was), member) == 1 then
                    redis.call("zrem", run_job_index(root, job, was), member)
                    fresh = true
                end
            end
        end
    else
        local old = redis.call("hget", hash, attempt)
        if old then
            local was = string.match(old, '"s":%s*"(%a+)"')
            if was == status then
                fresh = false
            elseif was then
                redis.call("zrem", run_job_index(root, job, was), member)
                redis.call("zrem", run_status_index(root, was), member)
            end
        end
        redis.call("hset", hash, attempt, record)
    end
    local ttl = run_ttl(status, completed_ttl, failed_ttl)
    if attempt ~= "1" and attempt ~= 1 and ttl < failed_ttl then
        ttl = failed_ttl
    end
    redis.call("pexpire", hash, int_texts[ttl] or int_text(ttl))
    local long_ttl = completed_ttl
    if failed_ttl > long_ttl then
        long_ttl = failed_ttl
    end
    if type(score) == "number" then
        score = int_text(score)
    end
    local indexes = record_indexes(root, job, status)
    index_add(indexes[1], score, member, long_ttl, vouched)
    index_add(indexes[2], score, member, long_ttl, vouched)
    if tenant ~= "" then
        index_add(root .. "runs:tenant:" .. tenant, score, member, long_ttl)
    end
    if origin ~= mid then
        index_add(root .. "runs:origin:" .. origin, score, member, long_ttl)
    end
    if fresh and status ~= "running" then
        local field = status == "completed" and duration_field(record) or status
        stat_add(stats_hash(root, job, now), field)
    end
end

-- flush_runs(): write what put_run gathered (index entries, with the TTL of the indexes not
-- vouched for refreshed to the longest record age plus the slack; stats counters, TTL 8 days
-- from the hour's first count: set when a count creates its field, which the count that
-- creates the hash always does).
local function flush_runs()
    for _, index in ipairs(pending_index_keys) do
        redis.call("zadd", index, unpack(pending_index[index]))
        if pending_index_refresh[index] then
            redis.call("pexpire", index, int_text(pending_index_ttl + INDEX_TTL_SLACK_MS))
        end
    end
    for _, hash in ipairs(pending_stats_keys) do
        local created = false
        for field, n in pairs(pending_stats[hash]) do
            if redis.call("hincrby", hash, field, int_text(n)) == n then
                created = true
            end
        end
        if created then
            redis.call("pexpire", hash, STATS_TTL_MS)
        end
    end
    pending_index, pending_index_keys, pending_index_refresh = {}, {}, {}
    pending_stats, pending_stats_keys = {}, {}
end

-- drop_runs(root, status, members): forget these records of `status` (run ids) and their
-- index entries: one ZREM per index for them all, one HGET and one HDEL per record (its job,
-- tenant and origin indexes are read off the record).
local function drop_runs(root, status, members)
    if #members == 0 then
        return
    end
    redis.call("zrem", run_status_index(root, status), unpack(members))
    local unindex, unindex_keys = {}, {}
    local function drop_from(index, member)
        group_add(unindex, unindex_keys, index, member)
    end
    for _, member in ipairs(members) do
        local mid, attempt = string.match(member, "^(.*):(%d+)$")
        local hash = mid and root .. "run:" .. mid
        local record = hash and redis.call("hget", hash, attempt)
        if record then
            redis.call("hdel", hash, attempt)
            local ok, run = pcall(cjson.decode, record)
            if ok and type(run) == "table" then
                if type(run.j) == "string" then
                    drop_from(run_job_index(root, run.j, status), member)
                end
                if type(run.t) == "string" then
                    drop_from(root .. "runs:tenant:" .. run.t, member)
                end
                if type(run.o) == "string" then
                    drop_from(root .. "runs:origin:" .. run.o, member)
                end
            end
        end
    end
    for _, index in ipairs(unindex_keys) do
        redis.call("zrem", index, unpack(unindex[index]))
    end
end

-- How many entries older than their status age one trim drops from one index at most: after
-- a quiet spell longer than that age, a whole index (up to the record cap) has aged out, and
-- dropping 100,000 entries at once holds Redis for about 11 ms (ZREMRANGEBYSCORE; 2,000 take
-- about 0.3 ms), so the rest goes over the next trims (one per about 32 records written).
local AGE_OUT_STEP = 2000

-- age_out(index, cutoff): drop the oldest entries of index scored before cutoff, at most
-- AGE_OUT_STEP of them (ZCOUNT finds how many by rank: no walk)
local function age_out(index, cutoff)
    local aged = redis.call("zcount", index, "-inf", "(" .. int_text(cutoff))
    if aged > 0 then
        redis.call("zremrangebyrank", index, 0, math.min(aged, AGE_OUT_STEP) - 1)
    end
end

-- trim_runs(root, cap, budget, completed TTL, failed TTL, at): drop index entries older than
-- their status age from the status and job indexes of `job` (if given; AGE_OUT_STEP per index
-- at most), then, while more than `cap` records are indexed, the oldest records, completed
-- first, then cancelled, failed and dead; at most `budget` of them (so a lowered cap is reached
-- over the next writes), each status's at once (drop_runs).
local function trim_runs(root, cap, budget, completed_ttl, failed_ttl, at, job)
    local total = 0
    for _, status in ipairs(RUN_STATUSES) do
        local cutoff = at - run_ttl(status, completed_ttl, failed_ttl)
        local index = run_status_index(root, status)
        age_out(index, cutoff)
        if job then
            age_out(run_job_index(root, job, status), cutoff)
        end
        total = total + redis.call("zcard", index)
    end
    budget = math.min(total - cap, budget)
    for _, status in ipairs({"completed", "cancelled", "failed", "dead"}) do
        if budget <= 0 then
            break
        end
        local oldest = redis.call("zrange", run_status_index(root, status), 0, budget - 1)
        drop_runs(root, status, oldest)
        budget = budget - #oldest
    end
end

-- run_of(root, body, worker): the run record fields of an encoded message kumiko wrote (its
-- attempt from its options), or nil for anything else (or when root is "": no history).
local function run_of(root, body, worker)
    if root == "" then
        return nil
    end
    local message = decode_message(body)
    if not message then
        return nil
    end
    local options = message.options
    if type(options.kumiko_trigger) ~= "string" or type(message.actor_name) ~= "string"
        or type(message.message_id) ~= "string" then
        return nil
    end
    local job = job_of(message.actor_name)
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
        b = text(options.kumiko_batch), cb = text(options.kumiko_batch_callback),
    }
end
