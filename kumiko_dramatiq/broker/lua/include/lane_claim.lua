-- include "lane_claim": claiming messages of a kumiko lane queue for this worker, the work of
-- fetch_lane.lua, also done by settle.lua for the consumer whose deliveries it settles (so a
-- steadily draining consumer sends one call per batch, not a settle and a fetch).
-- claim_lane(spec, done_prefix, root, run_worker, caps_arg, released) -> the reply of
-- fetch_lane (see there), and how many of the messages claimed were claimed to run now (the
-- first ones), with KEYS[1..3] and ARGV[1..2] as fetch_lane's:
--   spec "<N> <messages the consumer holds> <max deliveries> <TTL ms of completed and
--   cancelled run records> <TTL ms of failed ones>[ <now>]": of the N, the first <now> (all
--   without it) for threads that are free now, entered running; the rest ahead of the
--   consumer's threads, entered held (include/inflight.lua). A capped job's message is only
--   claimed to run now (a held message takes no slot: the claim stops before it). A message a
--   dead worker held (its entry held) is claimed again like any other, its deliveries counted
--   (it may have started just before the death), unless it was held or running during two
--   deaths: then it is a suspect. done_prefix the "already completed"
--   marker prefix ("" = no check); root "kumiko:<prefix>:"; run_worker "host:pid"; caps_arg
--   the slots' lease TTL ms (lanes with capped jobs only, else nil); released: the jobs whose
--   slot the caller gave back without ringing (caps_release with no list): each one's waiters
--   that this claim could not look at (no room, or not among the groups due first) get the
--   doorbell rung for them here, as caps_release would have.
-- Order (include/route.lua): while messages with a priority or a fair key wait in the queue's
-- order, the claim takes them by level, then in turn across the level's keys (route_take),
-- and only for threads free now (none held ahead: a held one would start before a more
-- urgent message that comes later). An id with a route met on the queue's list (put back
-- there by a requeue, a resume, a dead worker's recovery) is sent to its place, not claimed.
-- @include dispatch
-- @include inflight
-- @include caps
-- @include dead_letter
-- @include history
-- @include batch
-- @include bell
-- @include route

local function claim_lane(spec, done_prefix, root, run_worker, caps_arg, released)
    local inflight = KEYS[2]
    local suspects = KEYS[3]
    local wanted, held, max_deliveries, completed_ttl, failed_ttl, now_room =
        string.match(spec, "^(%d+) (%d+) (%d+) (%d+) (%d+) ?(%d*)$")
    if not wanted then
        error("kumiko: malformed claim head " .. tostring(spec))
    end
    wanted, max_deliveries = tonumber(wanted), tonumber(max_deliveries)
    now_room = tonumber(now_room) or wanted
    local ordered = redis.call("exists", queue_list .. ":order") == 1
    if ordered then
        wanted = math.min(wanted, now_room)
    end
    -- how many ids with a route this claim sent to their place
    local sorted = 0
    -- how many claims so far were entered running (the first now_room of them)
    local now_given = 0
    completed_ttl, failed_ttl = tonumber(completed_ttl), tonumber(failed_ttl)
    local idle = held == "0"
    local fetched, dropped, buried = {}, {}, {}
    local alone = 0
    local any_paused = redis.call("scard", root .. "paused") > 0
    local caps_ttl = tonumber(caps_arg or "")
    local caps_t, parked_here = 0, 0
    -- a fetch sets at most this many messages waiting (then rings for the next fetch to go on)
    local CAPS_PARK_BOUND = 64
    -- a claim in order looks at most this many ids
    local ORDER_STEPS = 256
    -- the caps' functions (include/caps.lua) and this script's own, made only with caps_arg;
    -- slot_of: rid -> {slots key, token} of the slots taken (a claim the "already completed"
    -- check drops gives its slot back at the end)
    local C, claim_capped, serve, slot_of = nil, nil, nil, {}

    -- the job of an encoded message, if it is one of a paused job's ("<job>" or nil)
    local function paused_job(body)
        local actor = body and actor_of(body)
        if not actor then
            return nil
        end
        local job = job_of(actor)
        if redis.call("sismember", root .. "paused", job) == 1 then
            return job
        end
        return nil
    end

    -- whether rid is one that cancel withdrew (its body deleted while it waited): forget it
    local function withdrawn(rid)
        if redis.call("srem", queue_list .. ":withdrawn", rid) == 1 then
            return true
        end
        if any_paused then
            for _, job in ipairs(redis.call("smembers", root .. "paused")) do
                if redis.call("srem", root .. "parked-withdrawn:" .. job, rid) == 1 then
                    return true
                end
            end
        end
        return false
    end

    -- claim(rid, seen, body): take rid for this consumer unless it was withdrawn or its job is
    -- paused; its "already completed" check and its writes are done for all claims at once
    -- (finish_claims)
    -- the candidates in parallel lists (a table per candidate costs more than its claim)
    local cand_rids, cand_seen, cand_bodies = {}, {}, {}
    local first_entry, first_held = nil, nil
    -- a capped message met once the room to run now was taken: the claim stops there
    local capped_stop = false
    local function claimed_count()
        return #fetched / 2 + #cand_rids
    end
    -- whether a message seen `seen` times before (its entry `entry`) is a suspect: it was
    -- running when a worker died, or held or running during two deaths (include/inflight.lua)
    local function is_suspect(seen, entry)
        return seen > 0 and (seen >= 2 or seen >= max_deliveries or not inflight_held(entry))
    end
    local function claim(rid, seen, body)
        if not body and withdrawn(rid) then
            redis.call("hdel", inflight, rid)
            return false
        end
        if any_paused then
            local job = paused_job(body)
            if job then
                redis.call("rpush", root .. "parked:" .. job, rid)
                return false
            end
        end
        local n = #cand_rids + 1
        cand_rids[n], cand_seen[n], cand_bodies[n] = rid, seen, body
        return true
    end

    local function finish_claims()
        if #cand_rids == 0 then
            return
        end
        local done, message_ids = {}, {}
        if done_prefix ~= "" then
            local markers, at = {}, {}
            for i = 1, #cand_rids do
                local body = cand_bodies[i]
                local message_id = body and message_id_of(body)
                if message_id then
                    markers[#markers + 1] = done_prefix .. message_id
                    at[#markers] = i
                    message_ids[i] = message_id
                end
            end
            if #markers > 0 then
                for j, value in ipairs(redis.call("mget", unpack(markers))) do
                    if value then
                        done[at[j]] = true
                    end
                end
            end
        end
        local acks, entries, gone = {}, {}, {}
        for i, rid in ipairs(cand_rids) do
            if done[i] then
                count_body(queue_messages, rid, cand_bodies[i], -1)
                gone[#gone + 1] = rid
                dropped[#dropped + 1] = message_ids[i]
            else
                acks[#acks + 1] = rid
                entries[#entries + 1] = rid
                -- text, not numbers: Lua formats a number with sprintf, about 3,000
                -- instructions each (head_now is the dispatch head's text of now); a first
                -- delivery's entry is the same for every claim of the call, built once
                local seen = cand_seen[i]
                local flag = ""
                if now_given < now_room then
                    now_given = now_given + 1
                else
                    flag = "h"
                end
                if seen ~= 0 then
                    entries[#entries + 1] = flag .. tostring(seen + 1) .. "|" .. head_now .. "|"
                        .. run_worker
                elseif flag == "" then
                    if not first_entry then
                        first_entry = "1|" .. head_now .. "|" .. run_worker
                    end
                    entries[#entries + 1] = first_entry
                else
                    if not first_held then
                        first_held = "h1|" .. head_now .. "|" .. run_worker
                    end
                    entries[#entries + 1] = first_held
                end
                fetched[#fetched + 1] = rid
                fetched[#fetched + 1] = cand_bodies[i]
            end
        end
        if #gone > 0 then
            redis.call("hdel", queue_messages, unpack(gone))
            redis.call("hdel", inflight, unpack(gone))
        end
        if #acks > 0 then
            redis.call("sadd", queue_acks, unpack(acks))
            redis.call("hset", inflight, unpack(entries))
        end
        cand_rids, cand_seen, cand_bodies = {}, {}, {}
    end

    if caps_ttl then
        C = caps_module()
        caps_t = C.caps_clock_ms()

        local function take(rid, cap, token)
            C.caps_take(root, cap, token, caps_t, caps_ttl)
            local slot_key = C.caps_slot_key(root, cap)
            if slot_key then
                slot_of[rid] = {slot_key, token}
            end
        end

        -- claim rid unless its job is at a cap: then it waits (at the end of its group's list)
        claim_capped = function(rid, seen, body)
            local cap = C.caps_of(body)
            if not cap then
                return claim(rid, seen, body)
            end
            if claimed_count() >= now_room then
                capped_stop = true -- a held message takes no slot: it waits for a free thread
                return false
            end
            local group, check_at, rated = C.caps_blocked(root, cap, caps_t)
            if group then
                if C.caps_park(root, group, rid, check_at) and rated then
                    ring(queue_list)  -- an idle consumer learns when the window opens
                end
                parked_here = parked_here + 1
                return false
            end
            if claim(rid, seen, body) then
                take(rid, cap, rid .. "#" .. (seen + 1))
                return true
            end
            return false
        end

        -- a waiter is claimed only to run now
        local has_room = function()
            return alone == 0 and claimed_count() < wanted and claimed_count() < now_room
        end

        -- the oldest waiters of group, claimed while their caps and this fetch have room
        serve = function(group)
            local list = root .. "capwait:" .. group
            while true do
                local rid = redis.call("lindex", list, 0)
                if not rid then
                    redis.call("zrem", caps_waiting(root), group)
                    return
                end
                local body = redis.call("hget", queue_messages, rid)
                local cap = C.caps_of(body)
                local moved_to, check_at = nil, nil
                if cap then
                    moved_to, check_at = C.caps_full(root, cap, caps_t)
                    if not moved_to then
                        local due = C.caps_rate_due(root, cap, caps_t)
                        if due > 0 then
                            moved_to, check_at = cap.group, due
                        end
                    end
                end
                if moved_to == group then
                    redis.call("zadd", caps_waiting(root), check_at, group)
                    return
                end
                if not moved_to and not has_room() then
                    redis.call("zadd", caps_waiting(root), 0, group)
                    ring(queue_list)
                    return
                end
                redis.call("lpop", list)
                C.caps_unwait(root, group)
                if moved_to then
                    if C.caps_park(root, moved_to, rid, check_at) and moved_to == cap.group
                        and moved_to ~= cap.job then
                        ring(queue_list)  -- an idle consumer learns when the window opens
                    end
                elseif not body then
                    if withdrawn(rid) then
                        redis.call("hdel", inflight, rid)
                    end
                else
                    local entry = redis.call("hget", inflight, rid)
                    local seen = inflight_count(entry)
                    if is_suspect(seen, entry) then
                        redis.call("rpush", suspects, rid)
                    elseif claim(rid, seen, body) and cap then
                        take(rid, cap, rid .. "#" .. (seen + 1))
                    end
                end
            end
        end
    end

    -- a suspect: bury it, run it alone, or set it aside
    local function suspect(rid, seen)
        if seen >= max_deliveries then
            local run = run_of(root, redis.call("hget", queue_messages, rid), run_worker)
            dead_letter(rid)
            redis.call("hdel", inflight, rid)
            buried[#buried + 1] = rid
            buried[#buried + 1] = seen
            if run then
                local reason = "worker died during " .. seen .. " deliveries"
                run.s, run.en, run.et, run.em, run.n = "dead", now, "WorkerDied", reason, seen
                put_run(root, run.m, run.a, run.j, "dead", run.t or "", run.o, run.q or now,
                    cjson.encode(run), completed_ttl, failed_ttl, now)
                redis.call("set", root .. "dead:" .. run.m, cjson.encode({
                    r = rid, q = queue, j = run.j, m = run.m, o = run.o, t = run.t, a = run.a,
                    ma = run.ma, et = "WorkerDied", em = reason, at = now,
                }), "PX", dead_ttl)
                batch_run_ended(root, run, "dead", now)
            end
        elseif idle and #fetched == 0 and #cand_rids == 0 and alone == 0 then
            local body = redis.call("hget", queue_messages, rid)
            local claimed
            if caps_ttl then
                claimed = claim_capped(rid, seen, body)
            else
                claimed = claim(rid, seen, body)
            end
            if claimed then
                finish_claims()
                if #fetched > 0 then
                    alone = 1
                end
            elseif capped_stop then
                redis.call("lpush", suspects, rid) -- it waits for a free thread, first in line
            end
        else
            redis.call("rpush", suspects, rid)
        end
    end

    if idle then
        while alone == 0 and not capped_stop do
            local rid = redis.call("lpop", suspects)
            if not rid then
                break
            end
            suspect(rid, inflight_count(redis.call("hget", inflight, rid)))
        end
    end
    -- the waiters whose caps may have room now, before newer messages (after the suspects: a
    -- suspect is only claimed by a fetch that has claimed nothing else)
    if caps_ttl then
        local due = redis.call("zrangebyscore", caps_waiting(root), "-inf", caps_t, "LIMIT", 0, 8)
        for _, group in ipairs(due) do
            serve(group)
        end
        finish_claims()
    end
    -- ids[from..] go back to the head of the list, in their order
    local function put_back(ids, from)
        local back = {}
        for j = #ids, from, -1 do
            back[#back + 1] = ids[j]
        end
        if #back > 0 then
            redis.call("lpush", queue_list, unpack(back))
        end
    end

    -- In order: the ids route_take gives, each looked at as one popped off the list; what a
    -- suspect claimed alone leaves goes back to the head of the list (sent to its place by
    -- the next claim)
    local steps = 0
    local function claim_in_order()
        local taken = {rids = {}, levels = {}, listed = {}, gone = {}}
        while alone == 0 and not capped_stop and claimed_count() < wanted
            and parked_here < CAPS_PARK_BOUND and steps < ORDER_STEPS do
            taken.rids, taken.levels, taken.listed = {}, {}, {}
            route_take(queue_list, wanted - claimed_count(), taken)
            local rids = taken.rids
            if #rids == 0 then
                break
            end
            steps = steps + #rids
            local bodies = redis.call("hmget", queue_messages, unpack(rids))
            local counts = redis.call("hmget", inflight, unpack(rids))
            local back = {}
            for i, rid in ipairs(rids) do
                if alone == 1 or capped_stop then
                    back[#back + 1] = rid
                else
                    local body, entry = bodies[i] or nil, counts[i] or nil
                    local seen = inflight_count(entry)
                    local level, key = nil, nil
                    if taken.listed[i] then
                        level, key = route_of(body)
                    end
                    if level then
                        route_push(queue_list, rid, level, key)
                        sorted = sorted + 1
                    elseif not body and not taken.listed[i] then
                        -- withdrawn (or purged with its queue): forgotten
                        if withdrawn(rid) then
                            route_withdrawn_at(queue_list, taken.levels[i], -1)
                        end
                        redis.call("hdel", inflight, rid)
                    elseif is_suspect(seen, entry) then
                        suspect(rid, seen)
                    elseif caps_ttl then
                        claim_capped(rid, seen, body)
                    else
                        claim(rid, seen, body)
                    end
                    if capped_stop then
                        back[#back + 1] = rid -- first in line, sent to its place then
                    end
                end
            end
            put_back(back, 1)
        end
        route_taken_counted(queue_list, taken)
        finish_claims()
    end
    if ordered then
        claim_in_order()
    end
    -- Pop what is wanted in one step, read the deliveries counts and bodies in one step each; a
    -- suspect that is claimed alone puts back what was popped after it (at the head, in order).
    while not ordered and alone == 0 and not capped_stop and #fetched / 2 < wanted
        and parked_here < CAPS_PARK_BOUND and sorted == 0 do
        local popped = redis.call("lpop", queue_list, wanted - #fetched / 2)
        if not popped then
            break
        end
        local counts = redis.call("hmget", inflight, unpack(popped))
        local bodies = redis.call("hmget", queue_messages, unpack(popped))
        for i, rid in ipairs(popped) do
            local seen = inflight_count(counts[i] or nil)
            local level, key = route_of(bodies[i] or nil)
            if level then
                -- sent to its place; what was popped after it goes back (the claim goes on
                -- in order)
                route_push(queue_list, rid, level, key)
                sorted = sorted + 1
                put_back(popped, i + 1)
                break
            elseif is_suspect(seen, counts[i] or nil) then
                suspect(rid, seen)
            elseif caps_ttl then
                claim_capped(rid, seen, bodies[i])
            else
                claim(rid, seen, bodies[i])
            end
            if alone == 1 or capped_stop then
                -- what was popped after a suspect claimed alone, or from the capped message
                -- that waits for a free thread on, goes back to the head, in order
                put_back(popped, capped_stop and i or i + 1)
                break
            end
        end
        finish_claims()
    end
    -- what the list held with a route was sent to its place: claimed from there now, in order
    if not ordered and sorted > 0 then
        wanted = math.min(wanted, now_room)
        claim_in_order()
    end
    flush_runs()
    local waiting = redis.call("llen", suspects)
    for _, job in ipairs(released or {}) do
        if tonumber(redis.call("zscore", caps_waiting(root), job) or "1") == 0 then
            ring(queue_list)
        end
    end
    local full = #fetched / 2 >= wanted or alone == 1 or parked_here >= CAPS_PARK_BOUND
        or capped_stop or steps >= ORDER_STEPS
    if (waiting > 0 and not idle) or ((full or sorted > 0) and (redis.call("llen", queue_list) > 0
        or redis.call("exists", queue_list .. ":order") == 1)) then
        ring(queue_list)
    end
    if not caps_ttl then
        return {fetched, dropped, buried, waiting, alone}, now_given
    end
    -- the slots of the claims made; a claim dropped as already completed gives its slot back
    local slots = {}
    for i = 1, #fetched, 2 do
        local slot = slot_of[fetched[i]]
        if slot then
            slots[#slots + 1] = fetched[i]
            slots[#slots + 1] = slot[1]
            slots[#slots + 1] = slot[2]
            slot_of[fetched[i]] = nil
        end
    end
    for _, slot in pairs(slot_of) do
        caps_release(slot[1], slot[2], queue_list)
    end
    local next_due = redis.call("zrange", caps_waiting(root), 0, 0, "WITHSCORES")
    local due_in = -1
    if next_due[2] then
        due_in = math.max(0, tonumber(next_due[2]) - caps_t)
    end
    return {fetched, dropped, buried, waiting, alone, slots, due_in}, now_given
end
