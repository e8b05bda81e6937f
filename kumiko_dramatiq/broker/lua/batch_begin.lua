-- batch_begin: the batch of one dispatch of a per-tenant job that declares on_complete or
-- on_success, begun by its wrapper before it fans out (include/batch.lua): its id is the
-- wrapper's, the wrapper its first child (its end is counted like its tenant children's).
-- KEYS[1] the batch hash "<root>batch:<wrapper id>"
-- ARGV[1] kumiko root   ARGV[2] the wrapper's id   ARGV[3] now (ms)   ARGV[4] Dramatiq's
-- namespace   ARGV[5] TTL (ms) of its records once ended   ARGV[6] the on_complete callback
-- ("<queue>\t<redis id>\t<encoded message>", or "")   ARGV[7] the on_success one (or "")
-- Returns 1 (begun), 0 (begun before: a wrapper that runs again).
-- @include ttl
local key, root, id, now = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
ttl_ms(ARGV[5], "batch record")
if redis.call("exists", key) == 1 then
    return 0
end
redis.call("hset", key, "kind", "batch", "state", "running", "total", 1, "pending", 1,
    "completed", 0, "dead", 0, "cancelled", 0, "created", now, "started", now, "ns", ARGV[4],
    "ttl", ARGV[5], "a:" .. id, "1")
for field, at in pairs({on_complete = 6, on_success = 7}) do
    if ARGV[at] ~= "" then
        redis.call("hset", key, field, ARGV[at])
    end
end
redis.call("rpush", key .. ":children", id)
redis.call("zadd", root .. "batches", now, id)
return 1
