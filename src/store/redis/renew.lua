-- tower-fairshare: renew the permits of calls still running on this replica, so a call that
-- holds a permit longer than the permit TTL keeps it (a replica that died renews nothing, and
-- its permits lapse by themselves).
-- KEYS: permits zsets. ARGV: 1 now in µs ("-1": Redis TIME), 2 the permit TTL (ms), 3 "XX" to
-- renew only members still there, "" to add them again (after Redis lost the tool's state);
-- then, for each key, the ids of its calls to renew, 16 bytes each, concatenated.
-- With XX a permit given back or pruned is not revived. Scores only move forward (GT).
-- Returns how many were renewed or added.
local now = tonumber(ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local ttl = tonumber(ARGV[2])
local until_ = string.format('%.17g', now + ttl * 1000)
local renewed = 0
for i, key in ipairs(KEYS) do
  local ids = ARGV[i + 3]
  local args = { 'ZADD', key, 'GT', 'CH' }
  if ARGV[3] == 'XX' then
    args[#args + 1] = 'XX'
  end
  local first = #args
  for j = 1, #ids, 16 do
    args[#args + 1] = until_
    args[#args + 1] = string.sub(ids, j, j + 15)
  end
  if #args > first then
    renewed = renewed + redis.call(unpack(args))
    -- Lengthen only: an injected clock's zsets are kept longer than the permit TTL.
    if redis.call('PTTL', key) < ttl then
      redis.call('PEXPIRE', key, ttl)
    end
  end
end
return renewed
