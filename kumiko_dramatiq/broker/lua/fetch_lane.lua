-- fetch_lane: claim up to N messages of a kumiko lane queue, keeping poison messages apart.
-- KEYS[1] namespace   KEYS[2] in-flight hash (redis id -> "<deliveries>|<claimed ms>|<worker>")
-- KEYS[3] suspects list of this queue (redis ids whose worker died while they were out)
-- ARGV[1..2] dispatch head (see include/dispatch.lua)
-- ARGV[3] "<N> <messages this consumer holds> <max deliveries> <TTL ms of completed and
--         cancelled run records> <TTL ms of failed ones>[ <now>]": claim up to N, the first
--         <now> (all without it) to run at once, the rest held ahead (include/lane_claim.lua);
--         a message delivered max deliveries times without an outcome (its worker died each
--         time) is dead-lettered here instead of delivered again
-- ARGV[4] "already completed" marker prefix ("" = no check)   ARGV[5] kumiko root
--         "kumiko:<prefix>:"   ARGV[6] this worker ("host:pid")
-- Each claimed id joins this worker's ack set and gets its in-flight entry, its deliveries
-- count one up (settle removes the entry): the run history reads running runs from there, so
-- the fetch decodes no message. A message of a paused job (in "<root>paused") is not claimed
-- but parked in "<root>parked:<job>" until the job is resumed. An id with deliveries already
-- (a suspect) is never delivered beside other messages: to a consumer that holds nothing it
-- is delivered alone (first from the suspects list), else it waits in the suspects list. A
-- message whose id carries an "already completed" marker is acked unrun. An id that cancel
-- withdrew (its body gone, the id in "<queue list>:withdrawn" or a paused job's
-- "<root>parked-withdrawn:<job>") is dropped without a word. A message at
-- the max is dead-lettered, its run record "dead" ("worker died during N deliveries"). The
-- queue's doorbell rings when a suspect is left waiting for an idle consumer, or a full batch
-- (or a suspect claimed alone) left messages behind.
-- ARGV[7] (lanes with capped jobs; "" or absent elsewhere) the lease TTL ms of a slot: a
--         message whose job is at one of its caps (include/caps.lua) is not claimed but waits
--         in its group's list; the groups due are looked at first (their oldest waiters
--         claimed as room allows)
-- ARGV[8..] (optional) the worker's hold block (include/holds.lua: hold_report): the starts
--         of messages it held, reported; the asks about what it holds, read
-- Returns {{rid, body, ...}, {message ids acked as already completed},
--          {rid, deliveries, ...} dead-lettered, suspects waiting, 1 if a suspect was claimed,
--          {rid, slots key, owner token, ...} slots taken, ms until a waiting group is due
--          (-1: none; these two with a caps TTL only), and with a hold block: how many of the
--          claimed ones (the first) run now, hold_report's reply}.
-- The claiming itself is include/lane_claim.lua's (settle.lua claims the same way).
-- @include lane_claim
-- @include holds
local reply, now_given = claim_lane(ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], nil)
if ARGV[8] then
    reply[#reply + 1] = now_given
    reply[#reply + 1] = hold_report(ARGV[5], worker, queue_acks, 8)
end
return reply
