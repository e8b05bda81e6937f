-- include "caps_release": giving a capped job's slot back (the part of include/caps.lua the
-- settle needs, kept apart so that a settle pays for nothing else). Every script that includes
-- it has the lane queue's name as ARGV[1] (the broker commands' convention,
-- include/dispatch.lua).
-- @include bell

-- @per-call
local caps_queue = ARGV[1]
-- @end per-call

-- the queue's sorted set of waiting groups (see include/caps.lua)
local function caps_waiting(root)
    return root .. "capwaiting:" .. caps_queue
end

-- give back the slot token holds in slots_key (a fair key's slots key gives back the job's
-- slot of the same token too, include/caps.lua); waiters of its groups are looked at now and
-- the queue's doorbell (list) rings for them (list nil: the caller claims for them itself and
-- rings if it could not, see include/lane_claim.lua). Returns the group given back that has
-- waiters (its key's first), if one has.
local function caps_release(slots_key, token, list)
    local root, group = string.match(slots_key, "^([^:]*:[^:]*:)slots:(.+)$")
    if not root or redis.call("zrem", slots_key, token) == 0 then
        return nil
    end
    local waiting = caps_waiting(root)
    local job = string.match(group, "^(.*):fair:%x*$")
    local woke = nil
    for _, each in ipairs({group, job or false}) do
        if each then
            if each == job then
                redis.call("zrem", root .. "slots:" .. job, token)
            end
            if redis.call("zscore", waiting, each) then
                redis.call("zadd", waiting, 0, each)
                woke = woke or each
            end
        end
    end
    if woke and list then
        ring(list)
    end
    return woke
end
