-- tower-fairshare: give back the concurrency permits of one admitted call.
-- KEYS: per level that took a permit, its permits zset then its state key.
-- ARGV: 1 the call's id.
-- A permit given back twice, or one that already lapsed and was pruned, removes nothing. The
-- last permit back at a level brings its state's TTL down to the state's own (it may go now).
local released = 0
for i = 1, #KEYS, 2 do
  local permits, key = KEYS[i], KEYS[i + 1]
  if redis.call('ZREM', permits, ARGV[1]) == 1 then
    released = released + 1
    if redis.call('ZCARD', permits) == 0 then
      local s = load_state(key)
      if s.live and s.in_flight > 0 then
        s.in_flight = 0
        s.key_until = 0
        redis.call('SET', key, encode_state(s), 'KEEPTTL')
        if s.deadline > 0 then
          redis.call('PEXPIREAT', key, math.max(s.deadline, 1))
        end
      end
    end
  end
end
return released
