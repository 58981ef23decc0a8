-- tower-fairshare: give back the concurrency permits of one admitted call (engine::release).
-- KEYS: the state keys of the levels that took a permit. In-flight never goes below 0, a key
-- that is gone is left gone; the last permit back brings the TTL down to the state's own.
for _, key in ipairs(KEYS) do
  local s = load_state(key)
  if s.live then
    local held = s.in_flight
    s.in_flight = math.max(s.in_flight - 1, 0)
    -- The last permit back: the state lives only as long as it matters (it may go now).
    local shorten = held > 0 and s.in_flight <= 0 and s.deadline > 0
    if shorten then
      s.key_until = 0
    end
    redis.call('SET', key, encode_state(s), 'KEEPTTL')
    if shorten then
      redis.call('PEXPIREAT', key, math.max(s.deadline, 1))
    end
  end
end
return 1
