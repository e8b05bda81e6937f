-- fetch_lane: claim up to N messages of a kumiko lane queue, keeping poison messages apart.
-- KEYS[1] namespace   KEYS[2] deliveries hash (redis id -> deliveries without an outcome)
-- KEYS[3] suspects list of this queue (redis ids whose worker died while they were out)
-- ARGV[1..6] dispatch head (see _dispatch.lua)
-- ARGV[7] N   ARGV[8] "already completed" marker prefix ("" = no check)
-- ARGV[9] messages this consumer holds (fetched, not yet acked)
-- ARGV[10] max deliveries: a message delivered this many times without an outcome (its
--          worker died each time) is dead-lettered here instead of delivered again
-- ARGV[11] run history root "kumiko:<prefix>:" ("" = keep no history)   ARGV[12] this
--          worker ("host:pid")   ARGV[13] TTL (ms) of a running or dead record and of a dead
--          letter's note   ARGV[14] the longest record TTL (ms)   ARGV[15] record cap
-- Each claimed id joins this worker's ack set and its deliveries count goes up by one; the
-- settle script clears it; a kumiko message also gets its "running" run record (attempt from
-- its options; a redelivery after a crash supersedes the record of the same attempt). An id
-- with deliveries already (a suspect) is never delivered
-- beside other messages: with ARGV[9] = 0 and nothing claimed yet it is delivered alone (first
-- from the suspects list), else it waits in the suspects list. A message whose id carries an
-- "already completed" marker is acked unrun.
-- Returns {{rid, body, ...}, {message ids acked as already completed},
--          {rid, deliveries, ...} dead-lettered, suspects waiting, 1 if a suspect was claimed}.
-- @include dispatch
-- @include dead_letter
-- @include history
local deliveries = KEYS[2]
local suspects = KEYS[3]
local wanted = tonumber(ARGV[7])
local done_prefix = ARGV[8]
local idle = tonumber(ARGV[9]) == 0
local max_deliveries = tonumber(ARGV[10])
local root, run_worker = ARGV[11], ARGV[12]
local run_ttl, long_ttl, cap = tonumber(ARGV[13]), tonumber(ARGV[14]), tonumber(ARGV[15])
local fetched, dropped, buried = {}, {}, {}
local alone = 0

-- The run record of a message kumiko wrote, as fields; nil for anything else.
local function run_of(body)
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
        q = tonumber(message.message_timestamp), w = run_worker,
        sa = text(options.kumiko_scheduled_at), dk = text(options.kumiko_dedup_key),
    }
end

local function write_run(run, status, ttl)
    run.s = status
    put_run(root, run.m, run.a, run.j, status, run.t or "", run.o, now, cjson.encode(run), ttl,
        long_ttl)
    trim_runs(root, cap)
end

local function claim(rid)
    redis.call("sadd", queue_acks, rid)
    redis.call("hincrby", deliveries, rid, 1)
    local body = redis.call("hget", queue_messages, rid)
    if body and done_prefix ~= "" then
        local ok, message = pcall(cjson.decode, body)
        if ok and type(message) == "table" and type(message.message_id) == "string"
            and redis.call("exists", done_prefix .. message.message_id) == 1 then
            redis.call("srem", queue_acks, rid)
            redis.call("hdel", queue_messages, rid)
            redis.call("hdel", deliveries, rid)
            dropped[#dropped + 1] = message.message_id
            return false
        end
    end
    fetched[#fetched + 1] = rid
    fetched[#fetched + 1] = body
    local run = run_of(body)
    if run then
        run.st = now
        run.n = tonumber(redis.call("hget", deliveries, rid))
        write_run(run, "running", run_ttl)
    end
    return true
end

-- a suspect: bury it, run it alone, or set it aside
local function suspect(rid, seen)
    if seen >= max_deliveries then
        local run = run_of(redis.call("hget", queue_messages, rid))
        dead_letter(rid)
        redis.call("hdel", deliveries, rid)
        buried[#buried + 1] = rid
        buried[#buried + 1] = seen
        if run then
            local reason = "worker died during " .. seen .. " deliveries"
            run.en, run.et, run.em, run.n = now, "WorkerDied", reason, seen
            write_run(run, "dead", run_ttl)
            redis.call("set", root .. "dead:" .. run.m, cjson.encode({
                r = rid, q = queue, j = run.j, m = run.m, o = run.o, t = run.t, a = run.a,
                ma = run.ma, et = "WorkerDied", em = reason, at = now,
            }), "PX", ARGV[5])
        end
    elseif idle and #fetched == 0 and alone == 0 then
        if claim(rid) then
            alone = 1
        end
    else
        redis.call("rpush", suspects, rid)
    end
end

if idle then
    while alone == 0 do
        local rid = redis.call("lpop", suspects)
        if not rid then
            break
        end
        suspect(rid, tonumber(redis.call("hget", deliveries, rid)) or 0)
    end
end
while alone == 0 and #fetched < 2 * wanted do
    local rid = redis.call("lpop", queue_list)
    if not rid then
        break
    end
    local seen = tonumber(redis.call("hget", deliveries, rid)) or 0
    if seen > 0 then
        suspect(rid, seen)
    else
        claim(rid)
    end
end
return {fetched, dropped, buried, redis.call("llen", suspects), alone}
