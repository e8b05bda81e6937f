-- include "group": values gathered per key, for one command per key (an HDEL per actor, a ZREM
-- per index) instead of one per value.
-- group_add(groups, order, key, value[, second]): append value (then second, if given) to
-- groups[key] (made on first use, its key then appended to order, so the keys are written in
-- the order first seen)
local function group_add(groups, order, key, value, second)
    local list = groups[key]
    if not list then
        list = {}
        groups[key] = list
        order[#order + 1] = key
    end
    list[#list + 1] = value
    if second ~= nil then
        list[#list + 1] = second
    end
end
