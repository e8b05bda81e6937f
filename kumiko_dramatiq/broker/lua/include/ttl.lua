-- include "ttl": check a TTL argument before anything is written.
-- ttl_ms(value, what) -> the TTL as a number; raises a script error (and the script writes
-- nothing) unless it is an integer from 1 to 2**48 ms (about 8,900 years; kumiko's own bound
-- is 366 days per duration). Lua does not roll back, so every script that writes several
-- keys checks its TTLs first: a write Redis would refuse half-way never leaves a record
-- without its TTL.
local function ttl_ms(value, what)
    local number = tonumber(value)
    if not number or number < 1 or number > 281474976710656 or number % 1 ~= 0 then
        error("kumiko: " .. what .. " TTL must be an integer from 1 to 2**48 ms, got "
            .. tostring(value))
    end
    return number
end
