-- dedup_dispatch_batch: many dispatches of one job under dedup keys, in order, in one step.
-- KEYS[1] queue messages hash   KEYS[2] queue list
-- ARGV[1] record TTL (ms)   ARGV[2] trigger   ARGV[3] the job's index of live records
-- (include/dedup_index.lua)
-- then per message, six arguments: the key's record, redis message id, encoded message,
-- message id, payload (JSON), the dedup key
-- Each is decided as dedup_dispatch decides it (include/dedup.lua); a key given twice in one batch
-- stands for the first message. Returns {1|0 (enqueued), the id the key stands for, ...}, a
-- pair per message, in order.
-- @include dedup
-- @include ttl
ttl_ms(ARGV[1], "dedup record")
local decided = {}
for i = 4, #ARGV, 6 do
    local one = dedup_dispatch(KEYS[1], KEYS[2], ARGV[i + 1], ARGV[i + 2], ARGV[i], ARGV[3],
        ARGV[i + 5], ARGV[1], ARGV[i + 3], ARGV[i + 4], ARGV[2])
    decided[#decided + 1] = one[1]
    decided[#decided + 1] = one[2]
end
return decided
