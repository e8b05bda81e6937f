-- enqueue: Dramatiq's enqueue command (kumiko's own enqueue of a new message is an enqueue
-- step behind its "sent" marker: guarded_enqueue).
-- KEYS[1] namespace
-- ARGV[1..2] dispatch head (see include/dispatch.lua)
-- ARGV[3] redis message id   ARGV[4] encoded message
-- Returns 1.
-- @include dispatch
-- @include enqueue
write_message(queue_messages, queue_list, ARGV[3], ARGV[4])
return 1
