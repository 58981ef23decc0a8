-- tower-fairshare: a batch of decisions' writes, applied only if no record the batch read has
-- changed since (compare-and-set on each record's 8-byte version). The new records, their
-- TTLs and the zset changes were all worked out in Rust; this script compares and copies.
-- KEYS: the records read (checked), then any other key written.
-- ARGV: 1 n, how many of KEYS are checked; 2..n+1 their versions when read ("": absent);
--   then the number of record writes and, for each, the index of its key, the record, its TTL
--   (ms; "": keep the key's TTL); then the number of zset operations and, for each, an op and the index of its key and
--   two arguments: A (ZADD score member), P (ZREMRANGEBYSCORE -inf score), E (PEXPIRE ms).
-- Returns 1 when applied, { 0, i } when KEYS[i] changed since it was read (nothing written).
local n = tonumber(ARGV[1])
for i = 1, n do
  if redis.call('GETRANGE', KEYS[i], 0, 7) ~= ARGV[1 + i] then
    return { 0, i }
  end
end
local at = n + 2
for _ = 1, tonumber(ARGV[at]) do
  local key, ttl = KEYS[tonumber(ARGV[at + 1])], ARGV[at + 3]
  if ttl == '' then
    redis.call('SET', key, ARGV[at + 2], 'KEEPTTL')
  else
    redis.call('SET', key, ARGV[at + 2], 'PX', ttl)
  end
  at = at + 3
end
at = at + 1
for _ = 1, tonumber(ARGV[at]) do
  local op, key = ARGV[at + 1], KEYS[tonumber(ARGV[at + 2])]
  if op == 'A' then
    redis.call('ZADD', key, ARGV[at + 3], ARGV[at + 4])
  elseif op == 'P' then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[at + 3])
  elseif op == 'E' then
    redis.call('PEXPIRE', key, ARGV[at + 3])
  end
  at = at + 4
end
return 1
