-- tower-fairshare: one whole admission decision, atomically. Mirrors
-- src/admission/engine.rs `decide` operation for operation, in the same f64 arithmetic.
--
-- Standalone (common.lua is not prepended) and written for speed: Redis runs it once per
-- decision and its cost bounds a Redis core. Locals and flat arrays instead of records, one
-- MGET for the states, literal struct formats, no closures beyond the few below; the
-- template trackers cost no command unless a caller is new or a tracked time is over.
--
-- KEYS: 1 tool state, 2 tool's tracker of template tenants, 3 tenant state,
--       4 tenant's tracker of template instances, 5 instance state (when there is one).
-- ARGV: 1 the plan, packed doubles (see `encode_plan` in mod.rs):
--   1 now (-1: Redis TIME), 2 cost, 3 period, 4 spare, 5 capacity, 6 tool burst,
--   7 configured tenant weight, 8 template tenant weight, 9 configured tenant burst,
--   10 template tenant burst, 11 tool max_concurrency (-1: none), 12 permit TTL (ms),
--   13 has instance; then per level (tenant at 14, instance at 29), 15 numbers: template,
--   max_tracked, weight, floor, has ceiling, ceiling, reserved floor, children's floor,
--   burst, borrow threshold, max_concurrency (-1: none), configured child weight, template
--   child weight, configured child burst, template child burst; then the budget lists of
--   tool, tenant (and instance): n, n x (period code, max).
-- Returns {1, admitted} or {0, refusal, window label}, numbers packed as doubles. Admitted:
--   now, remaining, slack, tenants counted, instances counted, then floor/share/ceiling
--   taken at tool, tenant, instance (the store derives the rest from the policy).
--
-- A level's state (one string; same layout in common.lua):
--   1 layout mark (-2), 2 t, 3 floor, 4 share, 5 ceiling, 6 window, 7 total, 8 non_floor,
--   9 floor_used, 10 in_flight (the engine's NodeState), 11 expires, 12-14 bucket rates
--   (floor, share, ceiling), 15-17 depths, 18 period (to recompute expiry), 19 deadline
--   (when the state may go, Redis clock, ms, permits aside), 20 until (tracked as a template
--   child until then, us; 0: not), 21 children tracked (its tracker's size), 22 a lower bound
--   of every score in its tracker (0: unknown), 23 when its tracker expires (us), 24 nb,
--   then nb x (period code, start, used).
--
-- Trackers (zsets, member: the child's state key) hold every template child tracked now,
-- scored with a lower bound of its `until` (the exact value is in the child's state, which
-- lives at least that long). The parent's state keeps their number and the least score;
-- only once `now` reaches that score are the members whose score has passed looked at:
-- re-scored if their `until` is later, removed if it is over. So the count excludes
-- expired members exactly, as the engine's rule says, without touching the zset per call.

local DS = '<dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd'
local HDR = '<dddddddddddddddddddddddd'
local MARK = -2
local EPS = 1e-9
local INF = math.huge
local HOUR = 3600000000
local DAY = 86400000000
local mfloor, mceil, mmin, mmax = math.floor, math.ceil, math.min, math.max
local spack, sunpack, ssub = struct.pack, struct.unpack, string.sub
local rcall = redis.call

local pa = ARGV[1]
local np = #pa / 8
local fmt
if np < 128 then fmt = ssub(DS, 1, np + 1) else fmt = '<' .. string.rep('d', np) end
local a = { sunpack(fmt, pa) }

local tm = rcall('TIME')
local rnow = tonumber(tm[1]) * 1000000 + tonumber(tm[2])
local rms = mfloor(rnow / 1000)
local now = a[1]
if now < 0 then now = rnow end
local c = a[2]
local period = a[3]
local spare = a[4]
local has_instance = a[13] == 1
local leaf = 2
if has_instance then leaf = 3 end

-- Budget lists: b_at[level] = index in `a` of the list's count.
local b_at = { 44, 0, 0 }
if not has_instance then b_at[1] = 29 end
b_at[2] = b_at[1] + 1 + 2 * a[b_at[1]]
if has_instance then b_at[3] = b_at[2] + 1 + 2 * a[b_at[2]] end

local window = mfloor(now / period)
local next_window = (window + 1) * period

-- H. Hinnant's civil calendar, as in src/clock.rs (all values are small whole numbers).
local function align(t, len)
  local s = mfloor(t / len) * len
  if s > t then
    s = s - len
  elseif s + len <= t then
    s = s + len
  end
  return s
end

-- The UTC calendar window [start, end) of budget period `code` that contains `t` (us).
local function budget_window(code, t)
  if code == 1 then
    local s = align(t, HOUR)
    return s, s + HOUR
  elseif code == 2 then
    local s = align(t, DAY)
    return s, s + DAY
  end
  local z = align(t, DAY) / DAY
  -- civil_from_days
  z = z + 719468
  local era = mfloor(z / 146097)
  local doe = z - era * 146097
  local yoe = mfloor((doe - mfloor(doe / 1460) + mfloor(doe / 36524) - mfloor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + mfloor(yoe / 4) - mfloor(yoe / 100))
  local mp = mfloor((5 * doy + 2) / 153)
  local m
  if mp < 10 then m = mp + 3 else m = mp - 9 end
  if m <= 2 then y = y + 1 end
  local ny, nm = y, m + 1
  if m == 12 then ny, nm = y + 1, 1 end
  local function days_from_civil(yy, mm)
    if mm <= 2 then yy = yy - 1 end
    local e = mfloor(yy / 400)
    local ye = yy - e * 400
    local mq
    if mm > 2 then mq = mm - 3 else mq = mm + 9 end
    local dy = mfloor((153 * mq + 2) / 5)
    return e * 146097 + ye * 365 + mfloor(ye / 4) - mfloor(ye / 100) + dy - 719468
  end
  return days_from_civil(y, m) * DAY, days_from_civil(ny, nm) * DAY
end

-- The states. s[25] is truthy for a state read from Redis, false for a fresh one.
local sk = { KEYS[1], KEYS[3], KEYS[5] }
local raws
if has_instance then
  raws = rcall('MGET', KEYS[1], KEYS[3], KEYS[5])
else
  raws = rcall('MGET', KEYS[1], KEYS[3])
end
local st = {}
for i = 1, leaf do
  local raw = raws[i]
  local s
  if raw and #raw >= 192 then
    s = { sunpack(HDR, raw) }
    if s[1] ~= MARK then s = nil end
  end
  if not s then
    s = { MARK, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, false }
    raws[i] = false
  end
  st[i] = s
end
local s1, s2, s3 = st[1], st[2], st[3]

local function refuse(reason, scope, wait, limit, used, reset_at, label, window_secs, sure_wait)
  local has_reset = 1
  if not reset_at then reset_at, has_reset = 0, 0 end
  return { 0, spack('<dddddddddd', now, reason, scope, wait, limit, used, has_reset, reset_at,
    window_secs or -1, sure_wait or 0), label }
end

-- Brings a parent's count of tracked template children up to date (see the top).
local function sync(zkey, ps)
  local cands = rcall('ZRANGEBYSCORE', zkey, '-inf', now)
  local n = #cands
  local i = 1
  while i <= n do
    local j = mmin(i + 255, n)
    local vals = rcall('MGET', unpack(cands, i, j))
    local live, dead = { 'ZADD', zkey, 'XX' }, { 'ZREM', zkey }
    for x = i, j do
      local v = vals[x - i + 1]
      local u = 0
      if v and #v >= 192 then
        local mark, until_ = sunpack('<d', v), sunpack('<d', v, 153)
        if mark == MARK then u = until_ end
      end
      if u > now then
        live[#live + 1] = u
        live[#live + 1] = cands[x]
      else
        dead[#dead + 1] = cands[x]
      end
    end
    if #live > 3 then rcall(unpack(live)) end
    if #dead > 2 then rcall(unpack(dead)) end
    i = j + 1
  end
  local count = rcall('ZCARD', zkey)
  local low = INF
  if count > 0 then
    low = tonumber(rcall('ZRANGE', zkey, 0, 0, 'WITHSCORES')[2])
  end
  ps[21], ps[22] = count, low
end

-- 1. Tracked template callers: a flood of new identities stops here.
local t_template = a[14] == 1
local i_template = has_instance and a[29] == 1
local n_tenants, n_instances = 0, 0
local tenant_tracked, instance_tracked = false, false
if t_template then
  if now >= s1[22] then sync(KEYS[2], s1) end
  n_tenants = s1[21]
  tenant_tracked = s2[25] and s2[20] > now
  if not tenant_tracked then
    if n_tenants >= a[15] then
      return refuse(2, 1, period, a[15], n_tenants, nil, 'callers')
    end
    n_tenants = n_tenants + 1
  end
end
if i_template then
  if now >= s2[22] then sync(KEYS[4], s2) end
  n_instances = s2[21]
  instance_tracked = s3[25] and s3[20] > now
  if not instance_tracked then
    if n_instances >= a[30] then
      return refuse(2, 2, period, a[30], n_instances, nil, 'callers')
    end
    n_instances = n_instances + 1
  end
end

-- 2. The numbers each level is owed right now (policy/numbers.rs `level_numbers`), and the
-- buckets (rates in s[12..14], depths in s[15..17], as the state stores them).
local own_floor = { 0, 0, 0 }
local ceiling_n = { a[5], 0, 0 }
local ceiling_rate = { spare, 0, 0 }
local threshold_of = { 0.5, a[23], 0 }
local caps = { a[11], a[24], -1 }
local scope_of = { 0, 1, 2 }
local t_share, t_ceiling
do
  -- The tool: floor and share buckets empty, the pool (spare, tool burst).
  s1[12], s1[13], s1[15], s1[16] = 0, 0, 0, 0
  local r = mmax(spare, 0)
  s1[14] = r
  if r > 0 then s1[17] = a[6] else s1[17] = 0 end
end
local function numbers(s, idx, p, spare_, total_weight)
  local share = 0
  if total_weight > 0 then
    share = spare_ * a[p + 2] / total_weight
  end
  local nominal = a[p + 3] + share
  local ceiling = nominal
  if a[p + 4] == 1 then ceiling = a[p + 5] end
  local reserved = a[p + 6]
  local of = mmax(reserved - a[p + 7], 0)
  local cr = mmax(ceiling - reserved, 0)
  own_floor[idx], ceiling_n[idx], ceiling_rate[idx] = of, ceiling, cr
  local burst = a[p + 8]
  local r = mmax(of, 0)
  s[12] = r
  if r > 0 then s[15] = of else s[15] = 0 end
  r = mmax(mmax(nominal - reserved, 0), 0)
  s[13] = r
  if r > 0 then s[16] = burst else s[16] = 0 end
  r = mmax(cr, 0)
  s[14] = r
  if r > 0 then s[17] = burst else s[17] = 0 end
  return share, ceiling
end
t_share, t_ceiling = numbers(s2, 2, 14, spare, a[7] + a[8] * n_tenants)
if has_instance then
  threshold_of[3], caps[3] = a[38], a[39]
  numbers(s3, 3, 29, mmax(t_ceiling - a[21], 0), a[25] + a[26] * n_instances)
end
-- What the children of the tool and of the tenant can hold in their share banks.
local banks = { a[9] + a[10] * n_tenants, a[27] + a[28] * n_instances, 0 }

for i = 1, leaf do
  local s = st[i]
  if not s[25] then
    s[25] = true
    s[2] = now
    s[3], s[4], s[5] = s[15], s[16], s[17]
  else
    local dt = mmax(now - s[2], 0)
    s[3] = mmin(s[3] + dt * s[12] / period, s[15])
    s[4] = mmin(s[4] + dt * s[13] / period, s[16])
    s[5] = mmin(s[5] + dt * s[14] / period, s[17])
    if now > s[2] then
      s[2] = now
    end
  end
  if s[6] ~= window then
    s[6], s[7], s[8], s[9] = window, 0, 0, 0
  end
end

-- 3. Concurrency, before any rate is looked at.
for i = 1, leaf do
  local cap = caps[i]
  if cap >= 0 and st[i][10] + 1 > cap then
    return refuse(3, scope_of[i], 1000000, cap, st[i][10], nil, 'in_flight')
  end
end

-- Budget counters of the levels with budgets: flat (period, start, used) runs.
local counters = {}
for i = 1, leaf do
  if a[b_at[i]] > 0 then
    local s = st[i]
    local nb = s[24]
    if nb > 0 and raws[i] then
      counters[i] = { sunpack(ssub(DS, 1, 3 * nb + 1), raws[i], 193) }
      counters[i][3 * nb + 1] = nil
    else
      counters[i] = {}
    end
  end
end

local fails = nil
local PERIOD_NAMES = { 'hour', 'day', 'month' }

-- 4. Budgets: every matching calendar window must have room.
for i = 1, leaf do
  local at = b_at[i]
  local bl = counters[i]
  for j = 0, a[at] - 1 do
    local code, bmax = a[at + 1 + 2 * j], a[at + 2 + 2 * j]
    local start, stop = budget_window(code, now)
    local used = 0
    for x = 1, #bl, 3 do
      if bl[x] == code and bl[x + 1] == start then
        used = bl[x + 2]
        break
      end
    end
    if used + c > bmax + EPS then
      local wait
      if c > bmax + EPS then wait = INF else wait = stop - now end
      fails = fails or {}
      fails[#fails + 1] = { 2, scope_of[i], wait, bmax, used, stop, PERIOD_NAMES[code],
        mfloor((stop - start) / 1e6), wait }
    end
  end
end

-- 5. The draw, from the caller up to the tool.
local function wait_for(x, need, rate, depth)
  if x + EPS >= need then
    return 0
  elseif need > depth + EPS or rate <= 0 then
    return INF
  end
  return (need - x) * period / rate
end

local function fail(at, need, rem, window_ok, window_cap)
  local s = st[at]
  local wait = wait_for(s[5], need, s[14], s[17])
  if not window_ok then
    local w
    if rem > window_cap + EPS then w = INF else w = next_window - now end
    wait = mmax(wait, w)
  end
  local lf = st[leaf]
  local lof = own_floor[leaf]
  if lof + EPS >= c then
    local fw = wait_for(lf[3], c, lf[12], lf[15])
    if lf[9] + c > lof + EPS then
      fw = mmax(fw, next_window - now)
    end
    wait = mmin(wait, fw)
  end
  -- Not in the engine: a lower bound of the time any path could pass this level (the least
  -- it must draw here, once every floor at and below it is full; no borrowing bar), for the
  -- local refusal cache, which must never refuse a call Redis would admit.
  local sure_wait = 0
  local rem_lb = c
  for j = at, leaf do
    rem_lb = rem_lb - own_floor[j]
  end
  if rem_lb > EPS then
    sure_wait = wait_for(s[5], rem_lb, s[14], s[17])
    if at == 1 and s[8] + rem_lb > ceiling_rate[1] + EPS then
      sure_wait = mmax(sure_wait, next_window - now)
    end
  end
  return { 1, scope_of[at], wait, ceiling_n[at], s[7], nil, '', nil, mmin(sure_wait, wait) }
end

-- Takes per level: tk[3 * (idx - 1) + 1..3] = floor, share, ceiling.
local function draw(share_first)
  local tk = { 0, 0, 0, 0, 0, 0, 0, 0, 0 }
  local rem = c
  local own_chain = true
  local child_threshold = 0.5
  for idx = leaf, 1, -1 do
    if rem <= EPS then
      break
    end
    local s = st[idx]
    local o = 3 * (idx - 1)
    local of = own_floor[idx]
    local done = false
    if of > 0 then
      local covered = 0
      if share_first and idx > 1 then
        covered = mmax(mmin(mmin(s[4], s[5]), rem), 0)
      end
      local x = mmax(mmin(mmin(rem - covered, s[3]), of - s[9]), 0)
      tk[o + 1] = x
      rem = rem - x
      done = rem <= EPS
    end
    if done then
      break
    end
    local threshold = 0
    if idx < leaf and not own_chain then
      local bk = banks[idx]
      threshold = bk + child_threshold * mmax(s[17] - bk - rem, 0)
    end
    local need = rem + threshold
    local window_cap
    if idx > 1 then
      window_cap = INF
    elseif threshold > 0 then
      window_cap = ceiling_rate[idx] - banks[idx]
    else
      window_cap = ceiling_rate[idx]
    end
    local bucket_ok = s[5] + EPS >= need
    local window_ok = s[8] + rem <= window_cap + EPS
    if not (bucket_ok and window_ok) then
      return nil, fail(idx, need, rem, window_ok, window_cap)
    end
    tk[o + 3] = rem
    if idx > 1 then
      if s[4] + EPS >= rem then
        tk[o + 2] = rem
      else
        own_chain = false
      end
      child_threshold = threshold_of[idx]
    end
  end
  return tk
end

local tk, f = draw(true)
if not tk then
  tk, f = draw(false)
  if not tk then
    fails = fails or {}
    fails[#fails + 1] = f
  end
end

if fails then
  local worst = fails[1]
  local sure_wait = worst[9]
  for i = 2, #fails do
    if fails[i][3] > worst[3] then
      worst = fails[i]
    end
    sure_wait = mmax(sure_wait, fails[i][9])
  end
  return refuse(worst[1], worst[2], worst[3], worst[4], worst[5], worst[6], worst[7], worst[8],
    sure_wait)
end

-- 6. Commit.
local track_until = mceil(now + period)
if t_template then s2[20] = track_until end
if i_template then s3[20] = track_until end
local floor_units = 0
for i = 1, leaf do
  local s = st[i]
  local o = 3 * (i - 1)
  local fl, h, k = tk[o + 1], tk[o + 2], tk[o + 3]
  floor_units = floor_units + fl
  s[3] = s[3] - fl
  s[4] = s[4] - h
  s[5] = s[5] - k
  s[7] = s[7] + c
  s[8] = s[8] + k
  s[9] = s[9] + fl
  if caps[i] >= 0 then
    s[10] = s[10] + 1
  end
  local bl = counters[i]
  if bl then
    local at = b_at[i]
    for j = 0, a[at] - 1 do
      local code = a[at + 1 + 2 * j]
      local start = budget_window(code, now)
      local found = nil
      for x = 1, #bl, 3 do
        if bl[x] == code then
          found = x
          break
        end
      end
      if found and bl[found + 1] == start then
        bl[found + 2] = bl[found + 2] + c
      elseif found then
        bl[found + 1] = start
        bl[found + 2] = c
      else
        bl[#bl + 1] = code
        bl[#bl + 1] = start
        bl[#bl + 1] = c
      end
    end
    s[24] = #bl / 3
  end
end
s1[9] = s1[9] + (floor_units - tk[1])

-- Trackers: a new member joins (and the zset lives as long as its latest member, rounded
-- up to 1/16 of a period so a busy tracker's TTL is not set on every call).
local function track(zkey, ps, member, tracked)
  if not tracked then
    ps[21] = ps[21] + rcall('ZADD', zkey, track_until, member)
    if track_until < ps[22] then ps[22] = track_until end
  end
  if not tracked or track_until > ps[23] then
    local q = period / 16
    local zexp = mceil(track_until / q) * q
    local ms = mceil((zexp - now) / 1000)
    if ms < 1 then ms = 1 end
    rcall('PEXPIRE', zkey, ms)
    ps[23] = zexp
  end
end
if t_template then track(KEYS[2], s1, KEYS[3], tenant_tracked) end
if i_template then track(KEYS[4], s2, KEYS[5], instance_tracked) end

local permit_ttl = a[12]
local wrote_period = period
for i = 1, leaf do
  local s = st[i]
  s[18] = wrote_period
  -- When the state is equivalent to a fresh one, from its own clock (engine::expiry).
  local t = s[2]
  local at = t
  if s[12] > 0 and s[3] < s[15] then at = mmax(at, t + (s[15] - s[3]) * period / s[12]) end
  if s[13] > 0 and s[4] < s[16] then at = mmax(at, t + (s[16] - s[4]) * period / s[13]) end
  if s[14] > 0 and s[5] < s[17] then at = mmax(at, t + (s[17] - s[5]) * period / s[14]) end
  if s[7] > 0 then at = mmax(at, (s[6] + 1) * period) end
  local bl = counters[i]
  local tail
  if bl then
    for x = 1, #bl, 3 do
      if bl[x + 2] > 0 then
        local _, e = budget_window(bl[x], bl[x + 1])
        at = mmax(at, e)
      end
    end
    if #bl > 0 then tail = spack(ssub(DS, 1, #bl + 1), unpack(bl)) else tail = '' end
  elseif s[24] > 0 then
    -- Counters no budget of the plan names: carried over as they are.
    for x = 0, s[24] - 1 do
      local code, start, used = sunpack('<ddd', raws[i], 193 + 24 * x)
      if used > 0 then
        local _, e = budget_window(code, start)
        at = mmax(at, e)
      end
    end
    tail = ssub(raws[i], 193)
  else
    tail = ''
  end
  at = mmax(at, now)
  s[11] = at
  -- The TTL: until the state is fresh and, for a tracked template child, its `until`.
  local keep = mmax(at, s[20])
  local ttl = mceil((keep - now) / 1000)
  if ttl < 1 then ttl = 1 end
  s[19] = rms + ttl
  if s[10] > 0 and ttl < permit_ttl then
    ttl = permit_ttl
  end
  rcall('SET', sk[i], spack(HDR, unpack(s, 1, 24)) .. tail, 'PX', ttl)
end

local lf = st[leaf]
local remaining = mmax(mmin(own_floor[leaf] - lf[9], lf[3]), 0)
local non_floor_room = INF
for i = 1, leaf do
  local s = st[i]
  local room = mmax(mmin(s[5], ceiling_rate[i] - s[8]), 0)
  non_floor_room = mmin(non_floor_room, room)
end
remaining = remaining + non_floor_room

return { 1, spack('<dddddddddddddd', now, remaining, s1[5], n_tenants, n_instances,
  tk[1], tk[2], tk[3], tk[4], tk[5], tk[6], tk[7], tk[8], tk[9]) }
