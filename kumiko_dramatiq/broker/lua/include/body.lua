-- include "body": reading an encoded message (a body in a queue's message hash), the one place
-- that knows how Dramatiq lays it out: {"queue_name", "actor_name", "args", "kwargs",
-- "options", "message_id", "message_timestamp"}, in that order, written compact.
-- decode_message(body) -> the decoded message if it is an object with an options object (the
--   shape every reader relies on), else nil; never raises
-- actor_of(body) -> the actor name Dramatiq wrote near the start (its first "actor_name"
--   field), found by a plain search without decoding the body, or nil
-- job_of(actor) -> the job a kumiko actor name belongs to (a per-tenant wrapper's
--   "<job>:fanout" is its job's)
-- message_id_of(body) -> the message id (its last field but one) without decoding, or nil
--   if the body does not end that way. Only the places where the field's name occurs are
--   tried (a plain search; a pattern search tries every position), near the end first (an id
--   of up to about 100 bytes), so a long body costs no scan of its whole length.
-- A string costs Redis's Lua about 12 instructions a byte to make, and a whole decode many
-- times more: readers that need one field use the plain searches, not decode_message.

local function decode_message(body)
    if not body then
        return nil
    end
    local ok, message = pcall(cjson.decode, body)
    if not ok or type(message) ~= "table" or type(message.options) ~= "table" then
        return nil
    end
    return message
end

local function actor_of(body)
    local at = string.find(body, '"actor_name":"', 1, true)
    if not at then
        return nil
    end
    return string.match(body, '^([^"]*)"', at + 14)
end

local function job_of(actor)
    if string.sub(actor, -7) == ":fanout" then
        return string.sub(actor, 1, -8)
    end
    return actor
end

local MESSAGE_ID_FIELD = '"message_id":"'
local MESSAGE_ID_REST = '^([^"]*)","message_timestamp":[%d.]+}$'
local function message_id_from(body, from)
    while true do
        local at = string.find(body, MESSAGE_ID_FIELD, from, true)
        if not at then
            return nil
        end
        local id = string.match(body, MESSAGE_ID_REST, at + 14)
        if id then
            return id
        end
        from = at + 1
    end
end

local function message_id_of(body)
    if #body > 160 then
        local id = message_id_from(body, #body - 160)
        if id then
            return id
        end
    end
    return message_id_from(body, 1)
end
