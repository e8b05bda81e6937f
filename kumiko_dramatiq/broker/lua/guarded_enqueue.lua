-- guarded_enqueue: enqueue a message with a deterministic id exactly once, behind its guard.
-- KEYS[1] queue messages hash   KEYS[2] queue list   KEYS[3] guard
-- ARGV[1] redis message id   ARGV[2] encoded message   ARGV[3] guard TTL (ms), or "0": a
-- "sent" key only read (include/guarded.lua)
-- ARGV[4] guard value
-- Optionally KEYS[4] the queue's counts hash (keys.queue_counts) and ARGV[5] the message's
-- field there ("q:<actor>", "d:<actor>" for a delay queue): its count is kept without
-- finding the names from the key and the body (see count_body in include/counts.lua).
-- Returns {1} (enqueued, guard set) or {0} (the guard existed, or with "0" the body: nothing
-- written).
-- @include guarded
local counted = KEYS[4] and {KEYS[4], ARGV[5]} or nil
return {enqueue_unless_guarded(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[3], ARGV[4], ARGV[3],
    counted)}
