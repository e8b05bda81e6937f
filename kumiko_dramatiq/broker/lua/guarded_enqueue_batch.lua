-- guarded_enqueue_batch: many messages of ONE queue, each behind its own guard, in one call.
-- KEYS[1] queue messages hash   KEYS[2] queue list
-- ARGV[1] guard TTL (ms), or "0": "sent" keys only read (include/guarded.lua)   ARGV[2] guard
-- value
-- then per message the triple (guard key, redis message id, encoded message)
-- Guard keys travel in ARGV (as Dramatiq's own scripts build their keys), so this targets a
-- single Redis, not a cluster. Returns one 1 (enqueued) or 0 (guard existed) per message.
-- @include guarded
local enqueued = {}
for i = 3, #ARGV, 3 do
    enqueued[#enqueued + 1] = enqueue_unless_guarded(KEYS[1], KEYS[2], ARGV[i + 1],
        ARGV[i + 2], ARGV[i], ARGV[2], ARGV[1])
end
return enqueued
