-- tower-fairshare: read the records of one call's levels and the permits they hold, writing
-- nothing (for `Store::inspect`: the console, `Limiter::explain`).
-- KEYS: n records, then their n permits zsets. ARGV: 1 now in µs, the decisions' clock ("-1":
-- Redis TIME).
-- Permits are counted as the decision counts them: those that have not lapsed by now.
local n = #KEYS / 2
local now = tonumber(ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local records = redis.call('MGET', unpack(KEYS, 1, n))
local counts = {}
local after = '(' .. string.format('%.17g', now)
for i = n + 1, #KEYS do
  counts[#counts + 1] = redis.call('ZCOUNT', KEYS[i], after, '+inf')
end
return { records, counts }
