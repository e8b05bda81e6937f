-- probe: may this user run every command kumiko sends, on every key it touches?
-- KEYS[1..]: none: the script itself touches no key (EVALSHA with 0 keys)
-- ARGV[1] the sample keys, one of each shape the process touches, separated by "\n"; a
--         sample that starts with "&" is a pub/sub channel (without the "&")
-- ARGV[2..] the commands to check (lower case; a subcommand as "client|id")
-- Nothing is run: each command is checked with redis.acl_check_cmd (Redis 7) with harmless
-- arguments, a command that takes keys once on each sample key; the work is bounded by the
-- commands and keys given, never by the keyspace.
-- Returns a flat list of findings, {kind, command, key, ...}, at most 32 of them, {} when
-- everything is allowed:
--   "key", "", key          no command may touch that key (its key pattern is missing)
--   "command", command, ""  the command may not run at all, or on no key
--   "pair", command, key    the command may not run on that key (others may)
--   "unknown", command, ""  no probe for that command here (a test keeps the table complete)
--   "channel", command, channel  the command may not use that channel
local K = {}  -- stands for the sample key
local C = {}  -- stands for a sample channel
local specs = {
    blpop = {K, "1"}, ["client|id"] = {}, ["client|setname"] = {"kumiko-probe"},
    ["client|unblock"] = {"0"}, del = {K},
    evalsha = {"0000000000000000000000000000000000000000", "1", K}, exec = {}, exists = {K},
    fcall = {"kumikofn_probe", "1", K}, ["function|load"] = {"#!lua name=kumikofn_probe"},
    get = {K}, hdel = {K, "f"}, hexists = {K, "f"}, hget = {K, "f"}, hgetall = {K}, hincrby = {K, "f", "1"},
    hkeys = {K}, hlen = {K}, info = {"memory"}, hmget = {K, "f"}, hscan = {K, "0"}, incr = {K},
    hset = {K, "f", "v"}, hsetnx = {K, "f", "v"}, keys = {"kumiko-probe"}, lindex = {K, "0"},
    llen = {K}, lpop = {K},
    lmove = {K, K, "LEFT", "RIGHT"}, lpos = {K, "v"},
    lpush = {K, "v"}, lrange = {K, "0", "0"}, lrem = {K, "0", "v"}, mget = {K}, multi = {},
    persist = {K}, pexpire = {K, "60000"}, ping = {}, pttl = {K}, role = {}, rpop = {K}, rpush = {K, "v"},
    sadd = {K, "m"}, scan = {"0"}, scard = {K}, ["script|load"] = {"return 1"},
    select = {"0"}, set = {K, "v", "PX", "60000"}, sismember = {K, "m"}, smembers = {K}, smismember = {K, "m"},
    srem = {K, "m"}, time = {}, zadd = {K, "0", "m"}, zcard = {K}, zcount = {K, "0", "0"},
    zrange = {K, "0", "0"}, zrangebyscore = {K, "0", "0"}, zrem = {K, "m"},
    zremrangebyrank = {K, "0", "-1"}, zremrangebyscore = {K, "0", "0"}, zrevrange = {K, "0", "0"},
    zrevrangebyscore = {K, "0", "0"}, zscore = {K, "m"},
    hincrby = {K, "f", "0"}, unlink = {K},  -- per-job counts (include/counts.lua)
    publish = {C, "m"}, subscribe = {C},  -- results (workflows/results.py)
}

local function argv_of(command, spec, key)
    local argv = {}
    for part in string.gmatch(command, "[^|]+") do
        argv[#argv + 1] = part
    end
    for _, arg in ipairs(spec) do
        argv[#argv + 1] = (arg == K) and key or arg
    end
    return argv
end

local function keyed(spec)
    for _, arg in ipairs(spec) do
        if arg == K then
            return true
        end
    end
    return false
end

local samples, channels = {}, {}
for key in string.gmatch(ARGV[1], "[^\n]+") do
    if string.sub(key, 1, 1) == "&" then
        channels[#channels + 1] = string.sub(key, 2)
    else
        samples[#samples + 1] = key
    end
end
local function on_channel(spec)
    return spec[1] == C
end
local findings, key_ok, denied, any_keyed = {}, {}, {}, false
local function note(kind, command, key)
    if #findings < 96 then
        findings[#findings + 1] = kind
        findings[#findings + 1] = command
        findings[#findings + 1] = key
    end
end
for i = 2, #ARGV do
    local command = ARGV[i]
    local spec = specs[command]
    if not spec then
        note("unknown", command, "")
    elseif on_channel(spec) then
        for _, channel in ipairs(channels) do
            local argv = argv_of(command, {}, "")
            argv[#argv + 1] = channel
            for j = 2, #spec do
                argv[#argv + 1] = spec[j]
            end
            if not redis.acl_check_cmd(unpack(argv)) then
                note("channel", command, channel)
            end
        end
    elseif not keyed(spec) then
        if not redis.acl_check_cmd(unpack(argv_of(command, spec, ""))) then
            note("command", command, "")
        end
    else
        any_keyed = true
        local allowed, refused = 0, {}
        for _, key in ipairs(samples) do
            if redis.acl_check_cmd(unpack(argv_of(command, spec, key))) then
                allowed = allowed + 1
                key_ok[key] = true
            else
                refused[#refused + 1] = key
            end
        end
        if allowed == 0 and #samples > 0 then
            note("command", command, "")
        else
            denied[#denied + 1] = {command, refused}
        end
    end
end
for _, key in ipairs(samples) do
    if any_keyed and not key_ok[key] then
        note("key", "", key)
    end
end
for _, entry in ipairs(denied) do
    for _, key in ipairs(entry[2]) do
        if key_ok[key] then
            note("pair", entry[1], key)
        end
    end
end
return findings
