-- count_attempt: count one attempt in a fixed window (the dashboard's sign-in rate limit).
-- KEYS[1] the counter of one client in the current window
-- ARGV[1] the window (ms)
-- The counter goes one up; the first attempt of a window (or a counter found without a TTL)
-- sets its TTL to the window, so it never outlives it.
-- Returns the attempts in the window so far, this one included.
-- @include ttl
ttl_ms(ARGV[1], "attempt window")
local count = redis.call("incr", KEYS[1])
if count == 1 or redis.call("pttl", KEYS[1]) < 0 then
    redis.call("pexpire", KEYS[1], ARGV[1])
end
return count
