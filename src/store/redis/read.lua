-- tower-fairshare: what a batch of decisions reads, in one atomic step: the time, the records of
-- every level the batch touches, and how many members of each tracker and permits zset still
-- count (their score, when a member stops counting, is after now). The decisions themselves are
-- made in Rust; this script does no arithmetic.
-- KEYS: the record keys, then the zset keys. ARGV: 1 now in µs ("-1": Redis TIME), 2 how many
-- of KEYS are record keys.
-- Returns { now (µs, as text), the records (nil where absent), the counts }.
local now = tonumber(ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local n = tonumber(ARGV[2])
local records = {}
if n > 0 then
  records = redis.call('MGET', unpack(KEYS, 1, n))
end
local after = '(' .. string.format('%.17g', now)
local counts = {}
for i = n + 1, #KEYS do
  counts[#counts + 1] = redis.call('ZCOUNT', KEYS[i], after, '+inf')
end
return { string.format('%.17g', now), records, counts }
