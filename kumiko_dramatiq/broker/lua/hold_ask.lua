-- hold_ask: ask the workers that hold some of the given messages about them (include/holds.lua).
-- KEYS[1] namespace
-- ARGV[1] the kumiko root "kumiko:<prefix>:"   ARGV[2] the lane queue   ARGV[3] the request id
-- ARGV[4] the kind asked ("probe", "cancel", "purge", "back")   ARGV[5..] redis ids
-- Each id a worker holds (claimed ahead of its threads, not started: its in-flight entry is
-- held, include/inflight.lua) has that worker asked. Returns {holder, redis id, request id to
-- wait on, ...} for those asked, and for each id that is running there {"", redis id, ""}.
-- @include holds
local namespace, root, queue, request, kind = KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local inflight = root .. "inflight"
local found = {}
for i = 5, #ARGV do
    local rid = ARGV[i]
    local entry = redis.call("hget", inflight, rid)
    if entry then
        local holder = holder_of(namespace, queue, rid)
        if holder and inflight_held(entry) then
            found[#found + 1] = holder
            found[#found + 1] = rid
            found[#found + 1] = hold_ask(root, holder, rid, request, kind)
        elseif holder then
            found[#found + 1] = ""
            found[#found + 1] = rid
            found[#found + 1] = ""
        end
    end
end
return found
