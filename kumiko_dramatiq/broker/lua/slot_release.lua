-- slot_release: give back slots of capped jobs held by deliveries that go back to their queue
-- unrun or cut short (a worker's shutdown, a fenced run).
-- KEYS[i] a job's slots (include/caps.lua)   ARGV[i] the owner token in KEYS[i]
-- ARGV[#KEYS + 1] the queue's list, whose doorbell rings for the job's waiters
-- Returns nothing.
-- @include caps
for i, key in ipairs(KEYS) do
    caps_release(key, ARGV[i], ARGV[#KEYS + 1])
end
return 0
