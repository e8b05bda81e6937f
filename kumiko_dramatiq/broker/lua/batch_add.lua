-- batch_add: a running child adds a child to its own batch (ctx.batch.add), counted and
-- enqueued in one step (include/batch.lua).
-- KEYS[1] the batch hash "<root>batch:<id>"
-- ARGV[1] kumiko root   ARGV[2] the new child's message id (derived from the adding run's
-- id and how many it added before: a run that runs again adds the same ids)   ARGV[3] its
-- queue   ARGV[4] its redis id   ARGV[5] its encoded message
-- Returns 1 (added), 0 (added before: nothing changes); an error when the batch is not
-- running.
-- @include batch
local key = KEYS[1]
if batch_join(ARGV[1], key, {ARGV[2]}) == 0 then
    return 0
end
batch_enqueue(redis.call("hget", key, "ns"), ARGV[3] .. "\t" .. ARGV[4] .. "\t" .. ARGV[5])
return 1
