-- tower-fairshare: a tool's epoch marker. Returns the marker Redis holds and keeps it a day
-- longer; when there is none (the first store to use the tool, or the state was lost since),
-- sets ARGV[1] and returns nil.
-- KEYS: 1 the marker. ARGV: 1 a new epoch, 2 its TTL (s).
local v = redis.call('GET', KEYS[1])
if v then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return v
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return false
