-- tower-fairshare: give back the concurrency permits of one admitted call.
-- KEYS: per level that took a permit, its permits zset then its record. ARGV: 1 the call's id,
-- 2 now in µs, the decisions' clock ("-1": Redis TIME).
-- A permit given back twice, or one that lapsed and was pruned, removes nothing. The last
-- permit back at a level lets its record go when the record itself may (its expiry: its
-- template counts are covered by its expiry, in the record at bytes 9 to 16), instead of the permit TTL it was kept for.
local now = tonumber(ARGV[2])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
-- 3: the least TTL to set, ms (an injected clock need not keep Redis's pace: see
-- `RedisStoreBuilder::injected_clock`).
local floor = tonumber(ARGV[3]) or 1
local released = 0
for i = 1, #KEYS, 2 do
  local permits, key = KEYS[i], KEYS[i + 1]
  if redis.call('ZREM', permits, ARGV[1]) == 1 then
    released = released + 1
    if redis.call('ZCARD', permits) == 0 then
      local raw = redis.call('GET', key)
      if raw and #raw >= 16 then
        local expires = struct.unpack('<d', raw, 9)
        local ms = math.ceil((expires - now) / 1000)
        if ms < floor then ms = floor end
        if ms < redis.call('PTTL', key) then
          redis.call('PEXPIRE', key, ms)
        end
      end
    end
  end
end
return released
