-- include "inflight": the in-flight hash "<root>inflight" (keys.inflight), redis id -> entry,
-- one per message a worker claimed from a lane queue and has not settled:
--   "<deliveries>|<ms>|<host:pid>"   running: claimed for a thread that was free (<ms> the
--                                    claim), or claimed ahead and reported started (<ms> the
--                                    start, see include/holds.lua)
--   "h<deliveries>|<ms>|<host:pid>"  held: claimed ahead of the worker's threads, not started
--                                    (not running anywhere: counts, busy, caps)
-- <deliveries> counts the claims of the message that ended without an outcome (its worker
-- died, include/lane_claim.lua), this one included; an entry left behind by a dead worker is
-- how the next fetch knows.
-- inflight_count(entry) -> the deliveries (0 for none), inflight_held(entry) -> whether it is held,
-- inflight_worker(entry) -> its host:pid (or nil), inflight_started(entry, ms) -> the running
-- entry of a held one that started at ms (text), inflight_requeued(entry) -> the entry of a
-- message that goes back to its queue unrun (its delivery undone), or nil for none.

-- A count of one digit (nearly every entry) is read off its first bytes: a pattern and a
-- tonumber cost about three times as much.
local function inflight_count(entry)
    if not entry then
        return 0
    end
    local first, second = string.byte(entry, 1, 2)
    local at = 1
    if first == 104 then -- "h"
        first, second = string.byte(entry, 2, 3)
        at = 2
    end
    if second == 124 and first and first >= 48 and first <= 57 then -- "<d>|"
        return first - 48
    end
    return tonumber(string.match(entry, "^(%d+)", at)) or 0
end

local function inflight_held(entry)
    return entry ~= nil and string.byte(entry, 1) == 104
end

local function inflight_worker(entry)
    return entry and string.match(entry, "^h?%d+|%d+|(.+)$")
end

local function inflight_started(entry, ms)
    local count, rest = string.match(entry, "^h(%d+)|%d+|(.*)$")
    if not count then
        return entry
    end
    return count .. "|" .. ms .. "|" .. rest
end

local function inflight_requeued(entry)
    local flag, count, rest = string.match(entry or "", "^(h?)(%d+)(|.*)$")
    if not count or tonumber(count) <= 1 then
        return nil
    end
    return flag .. (tonumber(count) - 1) .. rest
end
