-- include "caps_release": giving a capped job's slot back (the part of include/caps.lua the
-- settle needs, kept apart so that a settle pays for nothing else). Every script that includes
-- it has the lane queue's name as ARGV[1] (the broker commands' convention,
-- include/dispatch.lua).
-- @include bell

local caps_queue = ARGV[1]

-- the queue's sorted set of waiting groups (see include/caps.lua)
local function caps_waiting(root)
    return root .. "capwaiting:" .. caps_queue
end

-- give back the slot token holds in slots_key; waiters of its job are looked at now and the
-- queue's doorbell (list) rings for them
local function caps_release(slots_key, token, list)
    local root, job = string.match(slots_key, "^([^:]*:[^:]*:)slots:(.+)$")
    if not root or redis.call("zrem", slots_key, token) == 0 then
        return
    end
    local waiting = caps_waiting(root)
    if redis.call("zscore", waiting, job) then
        redis.call("zadd", waiting, 0, job)
        ring(list)
    end
end
