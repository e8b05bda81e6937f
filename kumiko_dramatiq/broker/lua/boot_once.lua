-- boot_once: enqueue a run_on_boot job once per dataset.
-- KEYS[1] queue messages hash   KEYS[2] queue list   KEYS[3] boot marker (no TTL)
-- KEYS[4] guard of the job's fixed message id
-- ARGV[1] redis message id   ARGV[2] encoded message   ARGV[3] guard TTL (ms)
-- ARGV[4] marker and guard value (the fixed message id)
-- Marker present: nothing. Else the message goes through its guard and the marker is set,
-- also when the guard already existed (which restores a lost marker without a second enqueue).
-- Returns {1, "enqueued"}, {0, "marked"} (marker present) or {0, "guarded"}.
-- @include guarded
ttl_ms(ARGV[3], "boot guard")
if redis.call("exists", KEYS[3]) == 1 then
    return {0, "marked"}
end
local fresh = enqueue_unless_guarded(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[4], ARGV[4], ARGV[3])
redis.call("set", KEYS[3], ARGV[4])
if fresh == 1 then
    return {1, "enqueued"}
end
return {0, "guarded"}
