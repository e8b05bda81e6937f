-- batch_join: children join a running batch before they are enqueued (a per-tenant wrapper's
-- tenant children: include/batch.lua). Joining first means the batch cannot end between two
-- chunks of a fan-out; a wrapper that runs again joins the same ids, counted once.
-- KEYS[1] the batch hash "<root>batch:<id>"
-- ARGV[1] kumiko root   ARGV[2..] the children's message ids
-- Returns how many joined as new; an error when the batch is not running.
-- @include batch
local ids = {}
for i = 2, #ARGV do
    ids[#ids + 1] = ARGV[i]
end
return batch_join(ARGV[1], KEYS[1], ids)
