-- hold_ask_job: one bounded step of asking the workers that hold messages of one job about
-- them (a purge, a pause: include/holds.lua), over the in-flight hash.
-- KEYS[1] namespace
-- ARGV[1] the kumiko root "kumiko:<prefix>:"   ARGV[2] the job's qualified name   ARGV[3] its
-- lane queue   ARGV[4] the HSCAN cursor of the in-flight hash ("0" to start)   ARGV[5] its
-- COUNT   ARGV[6] the request id   ARGV[7] the kind asked ("purge", "back")   ARGV[8] "1":
-- only count them (a dry run), ask nothing
-- Each held entry (include/inflight.lua) whose message in the lane queue's hash is the job's
-- (or its per-tenant wrapper's) has its holder (holder_of) asked. The in-flight hash holds
-- what the workers have claimed (at most twice their threads each), whatever the queues' size.
-- Returns {the next cursor ("0": done), {holder, redis id, request id to wait on, ...}}, a dry
-- run {the next cursor, how many are held}.
-- @include holds
local namespace, root, job, queue = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local request, kind, dry = ARGV[6], ARGV[7], ARGV[8] == "1"
local messages = namespace .. ":" .. queue .. ".msgs"
local reply = redis.call("hscan", root .. "inflight", ARGV[4], "COUNT", ARGV[5])
local entries = reply[2]
local asked, counted = {}, 0
for i = 1, #entries, 2 do
    local rid = entries[i]
    if inflight_held(entries[i + 1]) then
        local body = redis.call("hget", messages, rid)
        local actor = body and actor_of(body)
        if actor and job_of(actor) == job then
            local holder = holder_of(namespace, queue, rid)
            if holder then
                counted = counted + 1
                if not dry then
                    asked[#asked + 1] = holder
                    asked[#asked + 1] = rid
                    asked[#asked + 1] = hold_ask(root, holder, rid, request, kind)
                end
            end
        end
    end
end
if dry then
    return {reply[1], counted}
end
return {reply[1], asked}
