-- include "dispatch": the common head of the broker commands (Dramatiq's enqueue, fetch, ack,
-- nack, requeue, purge, qsize; kumiko's fetch_lane, settle and move), which all share one
-- calling convention:
--   KEYS[1]  namespace ("dramatiq"); command-specific keys follow
--   ARGV[1]  queue name
--   ARGV[2]  "<now ms> <worker id> <heartbeat timeout ms> <dead message TTL ms> <0|1>", the
--            last flag asking for maintenance on this queue first (one argument, so that
--            each call packs few)
--   command arguments start at ARGV[3]
-- It records the worker's heartbeat, runs maintenance when asked, and defines the names of
-- the queue's keys in Dramatiq's layout.
-- @include maintenance
-- @per-call
local namespace = KEYS[1]
local queue = ARGV[1]
local head_now, worker, head_heartbeat, head_dead_ttl, head_maintain =
    string.match(ARGV[2], "^(%d+) (%S+) (%d+) (%d+) ([01])$")
if not head_now then
    error("kumiko: malformed dispatch head " .. tostring(ARGV[2]))
end
local now = tonumber(head_now)
local dead_ttl = tonumber(head_dead_ttl)
local canonical = queue
if string.sub(queue, -3) == ".DQ" then
    canonical = string.sub(queue, 1, -4)
end
local queue_list = namespace .. ":" .. queue
local queue_messages = queue_list .. ".msgs"
local queue_acks = namespace .. ":__acks__." .. worker .. "." .. queue
local dead_letters = namespace .. ":" .. canonical .. ".XQ"
local dead_bodies = dead_letters .. ".msgs"
redis.call("zadd", namespace .. ":__heartbeats__", head_now, worker) -- text: no float formatting
if head_maintain == "1" then
    maintain(namespace, queue, now, tonumber(head_heartbeat), dead_ttl)
end
-- @end per-call
