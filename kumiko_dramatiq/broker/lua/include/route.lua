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

-- the field's name without its opening quote: a plain search tries each place where the
-- first character occurs, and "k" occurs in a body far less often than '"'
local ROUTE_FIELD = 'kumiko_route":"'

local function route_of(body)
    if not body then
        return nil
    end
    local at = string.find(body, ROUTE_FIELD, 1, true)
    if not at then
        return nil
    end
    local level, key = string.match(body, '^(%d)%.?(%x*)"', at + 15)
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

-- route_take(list, n, taken) -> taken: up to n more redis ids to look at, in priority and turn
--   order, appended to taken as three parallel lists (taken.rids, taken.levels, taken.listed:
--   whether it came off <list> itself, where an id with a route is one to send to its place).
--   Level 0's messages without a key (on <list>) take their turn in level 0's ring as key ""
--   while keyed ones wait there, and go before every later level; once only they are left,
--   the ring ends and <list> is claimed in batches again. A level with one key left gives
--   several ids in one pop. How many ids left each level's lists is added up in taken.gone,
--   for route_taken_counted to write once.
local function route_take(list, n, taken)
    local order = list .. ":order"
    local main_flag = list .. ":ring:0:main"
    local rids, levels, listed, gone = taken.rids, taken.levels, taken.listed, taken.gone
    local main = redis.call("llen", list)
    local first = redis.call("zrange", order, 0, 0)[1]
    local function add(rid, level, from_list)
        local at = #rids + 1
        rids[at], levels[at], listed[at] = rid, level, from_list
    end
    local wanted = #rids + n
    for _ = 1, n + 16 do
        if #rids >= wanted then
            break
        end
        if main > 0 and first ~= "0" then
            -- level 0's messages without a key, before every later level
            local popped = redis.call("lpop", list, wanted - #rids)
            for _, rid in ipairs(popped or {}) do
                add(rid, "0", true)
            end
            main = main - #(popped or {})
        elseif not first then
            break
        else
            local ring = list .. ":ring:" .. first
            if first == "0" and main > 0 and redis.call("exists", main_flag) == 0 then
                redis.call("rpush", ring, "")
                redis.call("set", main_flag, "1")
            end
            local keys_left = redis.call("llen", ring)
            local only = keys_left == 1 and redis.call("lindex", ring, 0)
            if keys_left == 0 or (first == "0" and only == "") then
                -- nothing left at this level (level 0: nothing but <list>'s turn)
                redis.call("del", ring, main_flag)
                redis.call("zrem", order, first)
                first = redis.call("zrange", order, 0, 0)[1]
            elseif only then
                -- one key: its oldest ids in one pop
                local at = list .. ":at:" .. first .. ":" .. only
                local popped = redis.call("lpop", at, wanted - #rids) or {}
                for _, rid in ipairs(popped) do
                    add(rid, first, false)
                end
                gone[first] = (gone[first] or 0) + #popped
                if redis.call("exists", at) == 0 then
                    redis.call("del", ring)
                    redis.call("zrem", order, first)
                    first = redis.call("zrange", order, 0, 0)[1]
                end
            else
                -- the key whose turn it is goes to the end of the ring (and off it once it
                -- has nothing left)
                local key = redis.call("lmove", ring, ring, "LEFT", "RIGHT")
                if first == "0" and key == "" then
                    local rid = redis.call("lpop", list)
                    main = main - 1
                    if main <= 0 then
                        redis.call("rpop", ring)
                        redis.call("del", main_flag)
                    end
                    if rid then
                        add(rid, "0", true)
                    end
                else
                    local at = list .. ":at:" .. first .. ":" .. key
                    local rid = redis.call("lpop", at)
                    if redis.call("exists", at) == 0 then
                        redis.call("rpop", ring)
                    end
                    if rid then
                        add(rid, first, false)
                        gone[first] = (gone[first] or 0) + 1
                    end
                end
            end
        end
    end
    if first == "0" and redis.call("llen", list .. ":ring:0") == 1
        and redis.call("lindex", list .. ":ring:0", 0) == "" then
        -- only <list>'s turn is left at level 0: the ring ends now, not at the next claim
        redis.call("del", list .. ":ring:0", main_flag)
        redis.call("zrem", order, "0")
    end
    return taken
end

-- route_taken_counted(list, taken): the ids route_take took off the order's lists leave their
-- levels' counts
local function route_taken_counted(list, taken)
    for level, count in pairs(taken.gone) do
        if redis.call("hincrby", list .. ":levels", level, -count) <= 0 then
            redis.call("hdel", list .. ":levels", level)
        end
    end
    taken.gone = {}
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
