-- tower-fairshare: one round trip of a tool's batches. First it writes what the last batch
-- decided, but only if no record that batch read has changed since (compare-and-set on each
-- record's 8-byte version); then it reads what the next batch needs: the time, the records of
-- every level it touches, and how many members of each permits zset still count (a member's
-- score is when its permit lapses). The decisions are made in Rust: this script
-- compares and copies, it does no arithmetic.
--
-- Under contention a turn decides who writes: a replica whose write found a record changed
-- claims the tool's turn with its next read (for 20 ms, if nobody holds it); while another
-- replica holds the turn, a write is refused as if a record had changed; the holder's write
-- gives the turn back. Without it, a replica whose reads ride on its writes would win every
-- race and starve the others.
--
-- Every read also reads the tool's epoch marker, and sets it (to the value given) when it is
-- missing: a marker that changed since a replica last read it means Redis lost the tool's
-- state (a restart without persistence, a flush), and the replica restores what it admitted.
--
-- KEYS: the write's keys (the records it checks, in order, then the zsets it changes), then the
-- read's record keys, then the read's zset keys, then the tool's epoch marker, then its turn key.
-- ARGV: 1 how many KEYS the write uses, 2 how many of those are checked records, 3 now for the
--   read in µs ("-1": Redis TIME; "": no read), 4 how many read record keys; then the write:
--   the checked records' versions when read ("": absent; a version then '*': that record or,
--   since it has expired, none); the number of record writes and, for
--   each, the index of its key, the record, its TTL in ms ("": keep the key's); the number of
--   zsets changed and, for each, the index of its key, the score up to which members are
--   dropped ("": none), its TTL in ms ("": keep), the number of members added and, for each,
--   its score and name; last, the epoch marker to set if it is missing and its TTL in seconds,
--   this replica's name and "1" to claim the turn with the read.
-- Returns { 1 written or 0, the index of the record that had changed (0: none; -1: another
--   replica's turn), now (the read's; without a read, Redis TIME), the records read (nil where
--   absent), the counts, 1 if another replica holds the turn when the script ends or 0, the
--   epoch marker (with a read; "" without) }.
local a, n = tonumber(ARGV[1]), tonumber(ARGV[2])
local turn, me, claim = KEYS[#KEYS], ARGV[#ARGV - 1], ARGV[#ARGV]
local holder = redis.call('GET', turn)
local written, changed = 1, 0
if holder and holder ~= me then
  written, changed = 0, -1
end
for i = 1, written == 1 and n or 0 do
  local want, have = ARGV[4 + i], redis.call('GETRANGE', KEYS[i], 0, 7)
  -- A version followed by '*': that record, or none (it expired: the same as a fresh one).
  if have ~= want and not (#want == 9 and (have == '' or have == string.sub(want, 1, 8))) then
    written, changed = 0, i
    break
  end
end
if written == 1 and a > 0 then
  local at = 5 + n
  for _ = 1, tonumber(ARGV[at]) do
    local key, ttl = KEYS[tonumber(ARGV[at + 1])], ARGV[at + 3]
    if ttl == '' then
      -- A correction: of a record that is still there (one that expired is a fresh one).
      if redis.call('EXISTS', key) == 1 then
        redis.call('SET', key, ARGV[at + 2], 'KEEPTTL')
      end
    else
      redis.call('SET', key, ARGV[at + 2], 'PX', ttl)
    end
    at = at + 3
  end
  at = at + 1
  for _ = 1, tonumber(ARGV[at]) do
    local key, upto, ttl, m = KEYS[tonumber(ARGV[at + 1])], ARGV[at + 2], ARGV[at + 3], tonumber(ARGV[at + 4])
    if upto ~= '' then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', upto)
    end
    if m > 0 then
      local add = { 'ZADD', key }
      for j = 1, 2 * m do
        add[#add + 1] = ARGV[at + 4 + j]
      end
      redis.call(unpack(add))
    end
    if ttl ~= '' then
      redis.call('PEXPIRE', key, ttl)
    end
    at = at + 4 + 2 * m
  end
  if holder == me then
    redis.call('DEL', turn)
    holder = false
  end
end
local t = redis.call('TIME')
local clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
if claim == '1' and not holder then
  redis.call('SET', turn, me, 'PX', 20)
  holder = me
end
local others = (holder and holder ~= me) and 1 or 0
if ARGV[3] == '' then
  return { written, changed, string.format('%.17g', clock), {}, {}, others, '' }
end
local now = tonumber(ARGV[3])
if now < 0 then
  now = clock
end
local r = tonumber(ARGV[4])
local records = {}
if r > 0 then
  records = redis.call('MGET', unpack(KEYS, a + 1, a + r))
end
local after = '(' .. string.format('%.17g', now)
local counts = {}
for i = a + r + 1, #KEYS - 2 do
  counts[#counts + 1] = redis.call('ZCOUNT', KEYS[i], after, '+inf')
end
local marker, epoch = KEYS[#KEYS - 1], redis.call('GET', KEYS[#KEYS - 1])
if epoch then
  redis.call('EXPIRE', marker, ARGV[#ARGV - 2])
else
  epoch = ARGV[#ARGV - 3]
  redis.call('SET', marker, epoch, 'EX', ARGV[#ARGV - 2])
end
return { written, changed, string.format('%.17g', now), records, counts, others, epoch }
