-- counts_backfill: one bounded step of counting what a queue held before its counts were kept
-- (include/counts.lua), so per-job counts are exact also over data written before an upgrade.
-- KEYS[1] the queue's counts hash   KEYS[2] its message hash   KEYS[3] its delay queue's
-- message hash   KEYS[4] its dead letters' message hash
-- ARGV[1] how many entries this step reads at most
-- First call (no "~mode"): with no message at all the counts are ready at once ("r"); else
-- counting starts ("b": from now on every body written or deleted is counted, see
-- include/counts.lua) and the walk begins. Each step reads at most ARGV[1] entries of one
-- hash (HSCAN, cursor kept in the counts hash as "~walk" = "<hash number> <cursor>") and
-- counts each body neither written since counting started ("<counts>:fresh") nor counted
-- already ("<counts>:seen": HSCAN may return an entry twice). After the last hash the counts
-- are ready and the two sets go. A step cut short (a crash) is taken up by the next call.
-- Returns 1 when the counts are ready, else 0 (call again).
-- @include counts
local counts, batch = KEYS[1], tonumber(ARGV[1])
local mode = redis.call("hget", counts, "~mode")
if mode == "r" then
    return 1
end
if not mode then
    if redis.call("hlen", KEYS[2]) + redis.call("hlen", KEYS[3]) + redis.call("hlen", KEYS[4])
        == 0 then
        redis.call("hset", counts, "~mode", "r")
        return 1
    end
    redis.call("unlink", counts, counts .. ":fresh", counts .. ":seen")
    redis.call("hset", counts, "~mode", "b", "~walk", "2 0")
end
local walk = redis.call("hget", counts, "~walk") or "2 0"
local index, cursor = string.match(walk, "^(%d+) (%d+)$")
index = tonumber(index)
local messages = KEYS[index]
local _, kind = counts_of(messages)
local reply = redis.call("hscan", messages, cursor, "COUNT", batch)
local entries = reply[2]
for i = 1, #entries, 2 do
    local member = kind .. entries[i]
    if redis.call("sismember", counts .. ":fresh", member) == 0
        and redis.call("sadd", counts .. ":seen", member) == 1 then
        local actor = actor_of(entries[i + 1])
        if actor then
            redis.call("hincrby", counts, kind .. ":" .. actor, 1)
        end
    end
end
if reply[1] ~= "0" then
    redis.call("hset", counts, "~walk", index .. " " .. reply[1])
    return 0
end
if index < 4 then
    redis.call("hset", counts, "~walk", (index + 1) .. " 0")
    return 0
end
redis.call("hset", counts, "~mode", "r")
redis.call("hdel", counts, "~walk")
redis.call("unlink", counts .. ":fresh", counts .. ":seen")
return 1
