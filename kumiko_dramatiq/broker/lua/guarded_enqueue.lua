-- guarded_enqueue: enqueue a message with a deterministic id exactly once, behind its guard.
-- KEYS[1] queue messages hash   KEYS[2] queue list   KEYS[3] guard
-- ARGV[1] redis message id   ARGV[2] encoded message   ARGV[3] guard TTL (ms)
-- ARGV[4] guard value
-- Returns {1} (enqueued, guard set) or {0} (the guard existed: nothing written).
-- @include guarded
return {enqueue_unless_guarded(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[3], ARGV[4], ARGV[3])}
