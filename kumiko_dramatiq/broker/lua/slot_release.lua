-- slot_release: give back slots of capped jobs held by deliveries that go back to their queue
-- unrun or cut short (a worker's shutdown, a fenced run).
-- KEYS[i] a job's slots (include/caps.lua)   ARGV[1] the lane queue's name   ARGV[2] its list,
-- whose doorbell rings for the job's waiters   ARGV[2 + i] the owner token in KEYS[i]
-- Returns 0.
-- @include caps_release
for i, key in ipairs(KEYS) do
    caps_release(key, ARGV[2 + i], ARGV[2])
end
return 0
