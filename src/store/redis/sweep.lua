-- tower-fairshare: drop, at a virtual `now` (an injected clock, whose time Redis's own TTLs do
-- not follow), every record that is equivalent to fresh state, template counts included (its
-- expiry is at bytes 9 to 16), and holds no permit, and from every permits (`!`) zset the
-- members whose time has passed; a zset that is left empty goes.
-- KEYS: keys to look at. ARGV: 1 now (µs). Returns how many keys were deleted.
local now = tonumber(ARGV[1])
local after = '(' .. string.format('%.17g', now)
local deleted = 0
for _, key in ipairs(KEYS) do
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'string' then
    local raw = redis.call('GET', key)
    if raw and #raw >= 16 then
      local expires = struct.unpack('<d', raw, 9)
      if expires <= now
          and redis.call('ZCOUNT', key .. '!', after, '+inf') == 0 then
        redis.call('DEL', key)
        deleted = deleted + 1
      end
    end
  elseif kind == 'zset' then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%.17g', now))
    if redis.call('ZCARD', key) == 0 then
      redis.call('DEL', key)
      deleted = deleted + 1
    end
  end
end
return deleted
