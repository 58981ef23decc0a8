-- tower-fairshare: drop the given keys' state once it is equivalent to fresh state at `now`
-- and no longer tracked as a template child (for an injected clock, whose time Redis's own
-- TTLs do not follow). Trackers lose the members whose tracked time is over (a member's
-- score is a lower bound: its state holds the exact time, see admit.lua), permits zsets
-- (keys ending in `!`) the permits whose time has passed, and both go when empty.
-- KEYS: keys to look at. ARGV: 1 now (us). Returns how many keys were deleted.
local now = tonumber(ARGV[1])
local deleted = 0
for _, key in ipairs(KEYS) do
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'string' then
    local s = load_state(key)
    local held = 0
    if s.in_flight > 0 then
      held = redis.call('ZCOUNT', key .. '!', '(' .. string.format('%.17g', now), '+inf')
    end
    if s.live and s.expires <= now and s.track_until <= now and held == 0 then
      redis.call('DEL', key)
      deleted = deleted + 1
    end
  elseif kind == 'zset' then
    if string.sub(key, -1) == '!' then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%.17g', now))
    else
      for _, member in ipairs(redis.call('ZRANGEBYSCORE', key, '-inf', now)) do
        local m = load_state(member)
        if m.live and m.track_until > now then
          redis.call('ZADD', key, 'XX', m.track_until, member)
        else
          redis.call('ZREM', key, member)
        end
      end
    end
    if redis.call('ZCARD', key) == 0 then
      redis.call('DEL', key)
      deleted = deleted + 1
    end
  end
end
return deleted
