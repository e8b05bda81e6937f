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

-- give back the slot token holds in slots_key; waiters of its job are looked at now and the
-- queue's doorbell (list) rings for them (list nil: the caller claims for them itself and
-- rings if it could not, see include/lane_claim.lua). Returns the job if it has waiters.
local function caps_release(slots_key, token, list)
    local root, job = string.match(slots_key, "^([^:]*:[^:]*:)slots:(.+)$")
    if not root or redis.call("zrem", slots_key, token) == 0 then
        return nil
    end
    local waiting = caps_waiting(root)
    if redis.call("zscore", waiting, job) then
        redis.call("zadd", waiting, 0, job)
        if list then
            ring(list)
        end
        return job
    end
    return nil
end
