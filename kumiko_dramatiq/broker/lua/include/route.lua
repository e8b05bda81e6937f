-- include "route": where a message of a lane queue waits, by its priority and fair key
-- (codec.py's kumiko_route, "<priority>" or "<priority>.<16 hex digits of its fair key>").
-- A message without one (priority 0, no fair key: every message of a job that uses neither)
-- waits on Dramatiq's list of the queue, <list>, as before. The others wait in the queue's
-- order, beside it (keys.queue_order_*):
--   <list>:order          sorted set: the levels ("0".."9") with keys waiting, scored by level
--   <list>:ring:<p>       list: the fair keys of level p with messages waiting, each once, in
--                         turn order ("" for the messages of level p without a key; at level
--                         0 that is <list> itself)
--   <list>:ring:0:main    "1" while "" is in level 0's ring for <list>
--   <list>:at:<p>:<key>   list: the redis ids waiting at level p under key, oldest first
--   <list>:levels         hash: level -> how many ids its lists hold (withdrawn ones included
--                         until a claim meets them, as on <list>), and "w<level>" -> how many
--                         of them cancel or purge withdrew (so the level's waiting messages
--                         are the difference, exactly)
-- A key is in its level's ring exactly while its list holds ids; a level is in the order
-- exactly while its ring holds keys. <list> is also where every other writer (a requeue, a
-- resume, a dead worker's messages going back) puts an id: the claim sends an id it pops
-- there with a route to its place (route_push) instead of claiming it.
-- route_of(body) -> level ("0".."9"), key digest ("" for none) of a body, or nil without a
--   route; one plain search, no decoding
-- route_push(list, rid, level, key) -> the length of the list rid went on: rid (its body in
--   the queue's hash already) waits at the end of its level and key
-- route_withdrawn(list, body, delta): the message of body, waiting in <list>'s order, was
--   withdrawn (+1: by cancel or purge, its id noted in "<list>:withdrawn") or met (-1: a claim
--   dropped its id)

local ROUTE_FIELD = '"kumiko_route":"'

local function route_of(body)
    if not body then
        return nil
    end
    local at = string.find(body, ROUTE_FIELD, 1, true)
    if not at then
        return nil
    end
    local level, key = string.match(body, '^(%d)%.?(%x*)"', at + 16)
    if not level or (level == "0" and key == "") then
        return nil
    end
    return level, key
end

local function route_push(list, rid, level, key)
    local at = list .. ":at:" .. level .. ":" .. key
    local length = redis.call("rpush", at, rid)
    redis.call("hincrby", list .. ":levels", level, 1)
    if length == 1 then
        redis.call("rpush", list .. ":ring:" .. level, key)
        redis.call("zadd", list .. ":order", tonumber(level), level)
    end
    return length
end

local function route_withdrawn_at(list, level, delta)
    local levels = list .. ":levels"
    local field = "w" .. level
    if delta > 0 then
        redis.call("hincrby", levels, field, 1)
    elseif tonumber(redis.call("hget", levels, field) or "0") > 0
        and redis.call("hincrby", levels, field, -1) <= 0 then
        redis.call("hdel", levels, field)
    end
end

local function route_withdrawn(list, body, delta)
    local level = route_of(body)
    if level then
        route_withdrawn_at(list, level, delta)
    end
end

-- route_next(list) -> the next redis id to look at in priority and turn order, its level, and
--   whether it came off <list> itself (where an id with a route is one to send to its place), or nil when
--   nothing waits. Level 0's messages without a key (on <list>) take their turn in level 0's
--   ring as key "" while keyed ones wait there, and go before every later level; once only
--   they are left, the ring ends and <list> is claimed in batches again.
local function route_next(list)
    local order = list .. ":order"
    local main_flag = list .. ":ring:0:main"
    for _ = 1, 16 do
        local first = redis.call("zrange", order, 0, 0)[1]
        if first ~= "0" then
            local rid = redis.call("lpop", list)
            if rid or not first then
                return rid, "0", true
            end
        end
        local ring = list .. ":ring:" .. first
        if first == "0" and redis.call("exists", main_flag) == 0
            and redis.call("llen", list) > 0 then
            redis.call("rpush", ring, "")
            redis.call("set", main_flag, "1")
        end
        local key = redis.call("lpop", ring)
        if not key then
            redis.call("zrem", order, first)
        elseif first == "0" and key == "" then
            local rid = redis.call("lpop", list)
            if redis.call("llen", ring) == 0 then
                -- no keyed message waits at level 0 any more
                redis.call("del", main_flag)
                redis.call("zrem", order, "0")
            elseif redis.call("llen", list) > 0 then
                redis.call("rpush", ring, "")
            else
                redis.call("del", main_flag)
            end
            if rid then
                return rid, "0", true
            end
        else
            local at = list .. ":at:" .. first .. ":" .. key
            local rid = redis.call("lpop", at)
            local left = redis.call("llen", ring)
            if redis.call("llen", at) > 0 then
                redis.call("rpush", ring, key)
            elseif left == 0 then
                redis.call("zrem", order, first)
            elseif first == "0" and left == 1 and redis.call("exists", main_flag) == 1 then
                -- only <list>'s turn is left at level 0
                redis.call("del", ring, main_flag)
                redis.call("zrem", order, "0")
            end
            if rid then
                if redis.call("hincrby", list .. ":levels", first, -1) <= 0 then
                    redis.call("hdel", list .. ":levels", first)
                end
                return rid, first, false
            end
        end
    end
    return nil, nil, false
end

-- route_clear(list): forget every id waiting in <list>'s order (Dramatiq's purge of the queue;
-- their bodies go with the queue's hash)
local function route_clear(list)
    for _, level in ipairs(redis.call("zrange", list .. ":order", 0, -1)) do
        local ring = list .. ":ring:" .. level
        for _, key in ipairs(redis.call("lrange", ring, 0, -1)) do
            redis.call("del", list .. ":at:" .. level .. ":" .. key)
        end
        redis.call("del", ring)
    end
    redis.call("del", list .. ":order", list .. ":levels", list .. ":ring:0:main")
end
