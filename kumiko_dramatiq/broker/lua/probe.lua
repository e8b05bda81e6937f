-- probe: which of the Redis commands kumiko's scripts run may this user not run?
-- KEYS[1] a probe key in Dramatiq's namespace   KEYS[2] a probe key under kumiko's prefix
-- ARGV[1..] the commands to try (lower case), each on "<KEYS[i]>:<command>" for both keys
-- Every command runs with harmless arguments on its own probe key, which is deleted after.
-- Returns {command, key, error, ...} for each command the user's ACL refuses (one entry per
-- command at most), or {} when all are allowed; a command without a probe here is returned
-- with the error "no probe" (a test keeps this table complete).
local arguments = {
    del = {}, exists = {}, get = {}, keys = {}, pexpire = {"60000"}, pttl = {},
    set = {"v", "PX", "60000"},
    hdel = {"f"}, hexists = {"f"}, hget = {"f"}, hgetall = {}, hincrby = {"f", "0"}, hlen = {},
    hmget = {"f"}, hset = {"f", "v"}, incr = {},
    llen = {}, lpop = {}, lpos = {"v"}, lpush = {"v"}, lrange = {"0", "0"}, lrem = {"0", "v"},
    rpop = {}, rpush = {"v"},
    sadd = {"m"}, scard = {}, sismember = {"m"}, smembers = {}, srem = {"m"},
    hscan = {"0"},
    zadd = {"0", "m"}, zcard = {}, zrange = {"0", "0"}, zrangebyscore = {"0", "0"}, zrem = {"m"},
    zremrangebyscore = {"0", "0"},
    time = {},
}
-- commands that take no key: run once, without one
local keyless = {time = true}
local refused = {}
local written = {}
for _, command in ipairs(ARGV) do
    local extra = arguments[command]
    if not extra then
        refused[#refused + 1] = command
        refused[#refused + 1] = ""
        refused[#refused + 1] = "no probe"
    else
        for _, base in ipairs(KEYS) do
            local key = base .. ":" .. command
            local target = key
            if command == "keys" then
                target = key .. "*"
            end
            written[#written + 1] = key
            local reply
            if keyless[command] then
                reply = redis.pcall(command)
            else
                reply = redis.pcall(command, target, unpack(extra))
            end
            if type(reply) == "table" and reply.err and (string.find(reply.err, "NOPERM", 1, true)
                or string.find(reply.err, "can't run", 1, true)
                or string.find(reply.err, "can't access", 1, true)) then
                refused[#refused + 1] = command
                refused[#refused + 1] = key
                refused[#refused + 1] = reply.err
                break
            end
        end
    end
end
for _, key in ipairs(written) do
    redis.pcall("del", key)
end
return refused
