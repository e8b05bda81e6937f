-- include "dispatch": the common head of the broker commands (enqueue, fetch, ack, nack,
-- requeue, purge, qsize and kumiko's ack variants), which all share one calling convention:
--   KEYS[1]  namespace ("dramatiq"); command-specific keys follow
--   ARGV[1]  queue name        ARGV[2]  now (ms)          ARGV[3]  worker id (broker id)
--   ARGV[4]  heartbeat timeout (ms)   ARGV[5]  dead message TTL (ms)
--   ARGV[6]  "1" to run maintenance on this queue first, else "0"
--   command arguments start at ARGV[7]
-- It records the worker's heartbeat, runs maintenance when asked, and defines the names of
-- the queue's keys in Dramatiq's layout.
-- @include maintenance
local namespace = KEYS[1]
local queue = ARGV[1]
local now = tonumber(ARGV[2])
local worker = ARGV[3]
local canonical = queue
if string.sub(queue, -3) == ".DQ" then
    canonical = string.sub(queue, 1, -4)
end
local queue_list = namespace .. ":" .. queue
local queue_messages = queue_list .. ".msgs"
local queue_acks = namespace .. ":__acks__." .. worker .. "." .. queue
local dead_letters = namespace .. ":" .. canonical .. ".XQ"
local dead_bodies = dead_letters .. ".msgs"
redis.call("zadd", namespace .. ":__heartbeats__", now, worker)
if ARGV[6] == "1" then
    maintain(namespace, queue, now, tonumber(ARGV[4]), tonumber(ARGV[5]))
end
