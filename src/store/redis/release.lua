-- tower-fairshare: give back the concurrency permits of one admitted call (engine::release).
-- KEYS: the state keys of the levels that took a permit. In-flight never goes below 0, a key
-- that is gone is left gone, and the key's TTL is kept.
for _, key in ipairs(KEYS) do
  local s = load_state(key)
  if s.live then
    s.in_flight = math.max(s.in_flight - 1, 0)
    redis.call('SET', key, encode_state(s), 'KEEPTTL')
  end
end
return 1
