-- dedup_dispatch: a dispatch under a dedup key (the producer's one decision, see include/dedup.lua).
-- KEYS[1] queue messages hash   KEYS[2] queue list   KEYS[3] the key's record
-- KEYS[4] the job's index of live records (include/dedup_index.lua)
-- ARGV[1] redis message id   ARGV[2] encoded message   ARGV[3] record TTL (ms)
-- ARGV[4] this message's id   ARGV[5] payload (JSON)   ARGV[6] trigger   ARGV[7] the dedup key
-- Returns {1, id} (enqueued) or {0, the id the key stands for}.
-- @include dedup
-- @include ttl
ttl_ms(ARGV[3], "dedup record")
return dedup_dispatch(KEYS[1], KEYS[2], ARGV[1], ARGV[2], KEYS[3], KEYS[4], ARGV[7], ARGV[3],
    ARGV[4], ARGV[5], ARGV[6])
