-- runs_from: where a page of run records starts in each run-history index (read only).
-- KEYS[1..n] run-history indexes (sorted sets of run ids "<message id>:<attempt>" scored by
-- the attempt's start in ms; see include/history.lua)
-- ARGV[1] the cursor's score ("+inf": no cursor)   ARGV[2] the cursor's run id ("": every
-- record at the cursor's score is past it, i.e. the cursor is a time)
-- The order is ZREVRANGE's: score high to low, then run id high to low. For each index, the
-- rank (0-based, in that order) of the first entry strictly after the cursor: the entries
-- above its score are counted, then the entries at its score are searched (binary, by rank),
-- so a page costs O(log n) however many records share a start.
-- Returns one rank per index.
local ranks = {}
for i, index in ipairs(KEYS) do
    if ARGV[1] == "+inf" then
        ranks[i] = 0
    else
        local above = redis.call("zcount", index, "(" .. ARGV[1], "+inf")
        local tied = redis.call("zcount", index, ARGV[1], ARGV[1])
        local low, high = above, above + tied
        while low < high do
            local middle = math.floor((low + high) / 2)
            local member = redis.call("zrevrange", index, middle, middle)[1]
            if member < ARGV[2] then
                high = middle
            else
                low = middle + 1
            end
        end
        ranks[i] = low
    end
end
return ranks
