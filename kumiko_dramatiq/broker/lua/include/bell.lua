-- include "bell": the doorbell of a queue, which its idle consumers wait on (BLPOP).
-- ring(list): a message was put on list <namespace>:<queue>; leave one token in the list
--   "<namespace>:<queue>:bell" unless one waits there already (queue names cannot contain
--   ":", so no queue's keys collide with it). A blocked consumer takes the token and fetches;
--   one token wakes one consumer, so a burst of enqueues does not wake every consumer for
--   every message (a consumer that fetched a full batch and left messages behind rings again,
--   see fetch and fetch_lane). A token nobody takes expires after a minute: the bell holds
--   at most one token and never outlives its listeners by more than that.
local function ring(list)
    local bell = list .. ":bell"
    if redis.call("exists", bell) == 0 then
        redis.call("rpush", bell, "1")
        redis.call("pexpire", bell, "60000")
    end
end
