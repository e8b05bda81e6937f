-- include "marks": the "already completed" markers (kumiko_dramatiq/middleware/history.py),
-- one set of message ids per window instead of one key per message: the ack of a batch adds
-- its completed ids with one SADD, a fetch looks its candidates up with two SMISMEMBERs, and
-- Redis holds and expires a few keys, not one per completed message.
--   prefix  "<root>done:<W>:" (keys.completed_marks): W, the window in ms, is part of the name
--   "<prefix><bucket>"  set of message ids completed in window `bucket` = floor(T / W), T
--           Redis's clock (TIME, ms: the same for every worker, whatever their clocks); it
--           expires at (bucket + 2) * W
-- A check looks at the current window and the one before, so a marker is found from its
-- write until at least W after it, at most 2W (never less than the resend window W).

-- marks_window(prefix) -> W (ms); raises a script error (nothing written yet) for a prefix
-- without a valid W
local function marks_window(prefix)
    local window = tonumber(string.match(prefix, ":(%d+):$") or "")
    if not window or window < 1 or window > 281474976710656 then
        error("kumiko: the completed marks' window TTL must be an integer from 1 to 2**48 ms, "
            .. "got the prefix " .. tostring(prefix))
    end
    return window
end

-- the current window of `prefix`'s marks, Redis's clock
local function marks_bucket(window)
    local time = redis.call("time")
    return math.floor((tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)) / window)
end

-- mark_completed(prefix, ids): note message ids `ids` (a list, may be empty) as completed now
local function mark_completed(prefix, ids)
    if #ids == 0 then
        return
    end
    local window = marks_window(prefix)
    local bucket = marks_bucket(window)
    local key = prefix .. string.format("%d", bucket)
    redis.call("sadd", key, unpack(ids))
    redis.call("pexpireat", key, string.format("%d", (bucket + 2) * window))
end

-- completed_among(prefix, ids) -> {[i] = true for each ids[i] marked completed}
local function completed_among(prefix, ids)
    local found = {}
    if #ids == 0 then
        return found
    end
    local window = marks_window(prefix)
    local bucket = marks_bucket(window)
    local now = redis.call("smismember", prefix .. string.format("%d", bucket), unpack(ids))
    local before = redis.call("smismember", prefix .. string.format("%d", bucket - 1), unpack(ids))
    for i = 1, #ids do
        if now[i] == 1 or before[i] == 1 then
            found[i] = true
        end
    end
    return found
end
