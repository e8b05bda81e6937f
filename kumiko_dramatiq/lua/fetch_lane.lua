-- fetch_lane: claim up to N messages of a kumiko lane queue, keeping poison messages apart.
-- KEYS[1] namespace   KEYS[2] deliveries hash (redis id -> deliveries without an outcome)
-- KEYS[3] suspects list of this queue (redis ids whose worker died while they were out)
-- ARGV[1..6] dispatch head (see _dispatch.lua)
-- ARGV[7] N   ARGV[8] "already completed" marker prefix ("" = no check)
-- ARGV[9] messages this consumer holds (fetched, not yet acked)
-- ARGV[10] max deliveries: a message delivered this many times without an outcome (its
--          worker died each time) is dead-lettered here instead of delivered again
-- ARGV[11] run history root "kumiko:<prefix>:" ("" = keep no history)   ARGV[12] this
--          worker ("host:pid")   ARGV[13] TTL (ms) of completed and cancelled records
--          ARGV[14] TTL (ms) of running, failed and dead ones   ARGV[15] record cap
-- Each claimed id joins this worker's ack set and its deliveries count goes up by one; the
-- settle script clears it; a message of a paused job (in the set "<root>paused") is not
-- claimed but parked in "<root>parked:<job>" until the job is resumed; a kumiko message
-- that is claimed gets its "running" run record (attempt from
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
local completed_ttl, failed_ttl = tonumber(ARGV[13]), tonumber(ARGV[14])
local cap = tonumber(ARGV[15])
local fetched, dropped, buried = {}, {}, {}
local alone = 0

local function write_run(run, status)
    run.s = status
    put_run(root, run.m, run.a, run.j, status, run.t or "", run.o, now, cjson.encode(run),
        completed_ttl, failed_ttl)
    trim_runs(root, cap)
end

local any_paused = root ~= "" and redis.call("scard", root .. "paused") > 0

-- the job of an encoded message, if it is one of a paused job's ("<job>" or nil)
local function paused_job(body)
    local actor = body and string.match(body, '"actor_name":"([^"]*)"')
    if not actor then
        return nil
    end
    local job = string.gsub(actor, ":fanout$", "")
    if redis.call("sismember", root .. "paused", job) == 1 then
        return job
    end
    return nil
end

local function claim(rid)
    local body = redis.call("hget", queue_messages, rid)
    if any_paused then
        local job = paused_job(body)
        if job then
            redis.call("rpush", root .. "parked:" .. job, rid)
            return false
        end
    end
    redis.call("sadd", queue_acks, rid)
    redis.call("hincrby", deliveries, rid, 1)
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
    local run = run_of(root, body, run_worker)
    if run then
        run.st = now
        run.n = tonumber(redis.call("hget", deliveries, rid))
        write_run(run, "running")
    end
    return true
end

-- a suspect: bury it, run it alone, or set it aside
local function suspect(rid, seen)
    if seen >= max_deliveries then
        local run = run_of(root, redis.call("hget", queue_messages, rid), run_worker)
        dead_letter(rid)
        redis.call("hdel", deliveries, rid)
        buried[#buried + 1] = rid
        buried[#buried + 1] = seen
        if run then
            local reason = "worker died during " .. seen .. " deliveries"
            run.en, run.et, run.em, run.n = now, "WorkerDied", reason, seen
            write_run(run, "dead")
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
