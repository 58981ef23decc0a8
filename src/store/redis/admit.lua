-- tower-fairshare: one whole admission decision, atomically. Mirrors
-- src/admission/engine.rs `decide` operation for operation, in the same f64 arithmetic.
--
-- Standalone (common.lua is not prepended) and written for speed: Redis runs it once per
-- decision and its cost bounds a Redis core. So: one MGET for the states; flat arrays, no
-- records; min/max written out (a call to math.min costs more than the comparison); the
-- struct formats are literals; helpers for rare paths are only made when needed; the
-- template trackers cost no command unless a caller is new or a tracked time is over; a
-- key's TTL is only set when it must grow.
--
-- KEYS: 1 tool state, 2 tool's tracker of template tenants, 3 tenant state,
--       4 tenant's tracker of template instances, 5 instance state (when there is one),
--       6 tool permits, 7 tenant permits, 8 instance permits (zsets: see below).
-- ARGV: 2 the call's id (16 bytes: the member of its permits). 1 the plan, packed doubles
--   (see `encode_plan` in wire.rs):
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
--   taken at tool, tenant, instance, then the depths of those nine buckets (the store
--   derives the rest from the policy).
--
-- Concurrency permits are per-call entries, not counters: a level with max_concurrency has a
-- zset (its state key and `!`) whose members are the ids of the calls holding a permit there,
-- each scored with the time its permit lapses (now + permit TTL, in the decisions' clock).
-- Calls in flight are the members whose time has not passed, so a permit that nobody gives
-- back (a replica that died) stops counting by itself after the permit TTL, whatever the
-- traffic. A live replica renews the permits of its calls still running (renew.lua).
--
-- A level's state (one string; the same layout in common.lua), doubles:
--   1 layout mark (-2; a state without it reads as absent), 2 t, 3 floor, 4 share,
--   5 ceiling, 6 window, 7 total, 8 non_floor, 9 floor_used, 10 permits held at this level
--   when it was last written (the engine's NodeState; the count that decides is the zset's), 11 until (tracked as a template child until then, us; 0: not), 12 until when
--   the key's TTL surely keeps it (us; 0: unknown), 13 template children tracked (its
--   tracker's size), 14 a lower bound of every score in its tracker (0: unknown), 15 when its
--   tracker expires (us), 16 nb; then, only written here: 17 expires, 18 deadline (when the
--   state may go, Redis clock, ms, permits aside), 19-21 bucket rates (floor, share,
--   ceiling), 22-24 depths, 25 period; then nb x (period code, start, used).
--
-- Trackers (zsets, member: the child's state key) hold every template child tracked now,
-- scored with a lower bound of its `until` (the exact value is in the child's state, whose
-- TTL keeps it at least that long). The parent's state keeps their number and the least
-- score; only once `now` reaches that score are the members whose score has passed looked
-- at: re-scored if their `until` is later, removed if it is over. So the count excludes
-- expired members exactly, as the engine's rule says, without a zset command per call.

local HOT = '<dddddddddddddddd'
local FULL = '<ddddddddddddddddddddddddd'
local DS = '<dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd'
local MARK = -2
local EPS = 1e-9
local INF = math.huge
local mfloor, mceil = math.floor, math.ceil
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
-- Where each level's budget list starts in `a` (its count; 0: no list).
local b1, b2, b3 = 29, 0, 0
if has_instance then leaf, b1 = 3, 44 end
b2 = b1 + 1 + 2 * a[b1]
if has_instance then b3 = b2 + 1 + 2 * a[b2] end

local window = mfloor(now / period)
local next_window = (window + 1) * period

-- The states. s[17] is truthy for a state read from Redis, false for a fresh one.
local raws
if has_instance then
  raws = rcall('MGET', KEYS[1], KEYS[3], KEYS[5])
else
  raws = rcall('MGET', KEYS[1], KEYS[3])
end
local st = {}
local any_budget = a[b1] > 0 or a[b2] > 0 or (b3 > 0 and a[b3] > 0)
for i = 1, leaf do
  local raw = raws[i]
  local s
  if raw and #raw >= 200 then
    s = { sunpack(HOT, raw) }
    if s[1] ~= MARK then
      s = nil
    elseif s[16] > 0 then
      any_budget = true
    end
  end
  if not s then
    s = { MARK, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, false }
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

-- 1. Tracked template callers: a flood of new identities stops here.
local t_template = a[14] == 1
local i_template = has_instance and a[29] == 1
if (t_template and now >= s1[14]) or (i_template and now >= s2[14]) then
  -- Brings a parent's count of tracked template children up to date (see the top).
  local function sync(zkey, ps)
    local cands = rcall('ZRANGEBYSCORE', zkey, '-inf', now)
    local n = #cands
    local i = 1
    while i <= n do
      local j = i + 255
      if n < j then j = n end
      local vals = rcall('MGET', unpack(cands, i, j))
      local live, dead = { 'ZADD', zkey, 'XX' }, { 'ZREM', zkey }
      for x = i, j do
        local v = vals[x - i + 1]
        local u = 0
        if v and #v >= 200 then
          local mark, until_ = sunpack('<d', v), sunpack('<d', v, 81)
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
    ps[13], ps[14] = count, low
  end
  if t_template and now >= s1[14] then sync(KEYS[2], s1) end
  if i_template and now >= s2[14] then sync(KEYS[4], s2) end
end
local n_tenants, n_instances = 0, 0
local tenant_tracked, instance_tracked = false, false
if t_template then
  n_tenants = s1[13]
  tenant_tracked = s2[17] and s2[11] > now
  if not tenant_tracked then
    if n_tenants >= a[15] then
      return refuse(2, 1, period, a[15], n_tenants, nil, 'callers')
    end
    n_tenants = n_tenants + 1
  end
end
if i_template then
  n_instances = s2[13]
  instance_tracked = s3[17] and s3[11] > now
  if not instance_tracked then
    if n_instances >= a[30] then
      return refuse(2, 2, period, a[30], n_instances, nil, 'callers')
    end
    n_instances = n_instances + 1
  end
end

-- 2. The numbers each level is owed right now (policy/numbers.rs `level_numbers`) and its
-- buckets (engine `bucket`), flat: level i at o = 16 * (i - 1): o+1 own floor, o+2 ceiling,
-- o+3 ceiling rate, o+4 borrow threshold, o+5 max_concurrency (-1: none), o+6 share bank of
-- its children, o+7 its budget list in `a`, o+8..o+10 rates (floor, share, ceiling),
-- o+11..o+13 depths. The tool: floor and share buckets empty, the pool (spare, tool burst).
local pool_rate = spare
if 0 > pool_rate then pool_rate = 0 end
local pool_depth = 0
if pool_rate > 0 then pool_depth = a[6] end
local lv = {
  0, a[5], spare, 0.5, a[11], a[9] + a[10] * n_tenants, b1, 0, 0, pool_rate, 0, 0, pool_depth, 0, 0, 0,
  0, 0, 0, a[23], a[24], a[27] + a[28] * n_instances, b2, 0, 0, 0, 0, 0, 0, 0, 0, 0,
  0, 0, 0, 0, -1, 0, b3, 0, 0, 0, 0, 0, 0, 0, 0, 0,
}
-- Returns the level's ceiling (its children's spare depends on it).
local function numbers(p, o, spare_, total_weight)
  local share = 0
  if total_weight > 0 then
    share = spare_ * a[p + 2] / total_weight
  end
  local nominal = a[p + 3] + share
  local ceiling = nominal
  if a[p + 4] == 1 then ceiling = a[p + 5] end
  local reserved = a[p + 6]
  local of = reserved - a[p + 7]
  if 0 > of then of = 0 end
  local cr = ceiling - reserved
  if 0 > cr then cr = 0 end
  local burst = a[p + 8]
  lv[o + 1], lv[o + 2], lv[o + 3] = of, ceiling, cr
  local r = of
  if 0 > r then r = 0 end
  lv[o + 8] = r
  if r > 0 then lv[o + 11] = of end
  r = nominal - reserved
  if 0 > r then r = 0 end
  lv[o + 9] = r
  if r > 0 then lv[o + 12] = burst end
  lv[o + 10] = cr
  if cr > 0 then lv[o + 13] = burst end
  return ceiling
end
local t_ceiling = numbers(14, 16, spare, a[7] + a[8] * n_tenants)
if has_instance then
  lv[36], lv[37] = a[38], a[39]
  local inner_spare = t_ceiling - a[21]
  if 0 > inner_spare then inner_spare = 0 end
  numbers(29, 32, inner_spare, a[25] + a[26] * n_instances)
end

for i = 1, leaf do
  local s, o = st[i], 16 * (i - 1)
  if not s[17] then
    s[17] = true
    s[2] = now
    s[3], s[4], s[5] = lv[o + 11], lv[o + 12], lv[o + 13]
  else
    local t = s[2]
    local dt = now - t
    if 0 > dt then dt = 0 end
    local x, d = s[3] + dt * lv[o + 8] / period, lv[o + 11]
    if d < x then x = d end
    local y, e = s[4] + dt * lv[o + 9] / period, lv[o + 12]
    if e < y then y = e end
    local z, f = s[5] + dt * lv[o + 10] / period, lv[o + 13]
    if f < z then z = f end
    if now > t then
      t = now
    end
    s[2], s[3], s[4], s[5] = t, x, y, z
  end
  if s[6] ~= window then
    s[6], s[7], s[8], s[9] = window, 0, 0, 0
  end
end

-- 3. Concurrency, before any rate is looked at: the permits whose time has not passed.
local flight = { 0, 0, 0 }
local now_s = nil
for i = 1, leaf do
  local cap = lv[16 * (i - 1) + 5]
  if cap >= 0 then
    if not now_s then now_s = string.format('%.17g', now) end
    local n = rcall('ZCOUNT', KEYS[5 + i], '(' .. now_s, '+inf')
    flight[i] = n
    if n + 1 > cap then
      return refuse(3, i - 1, 1000000, cap, n, nil, 'in_flight')
    end
  end
end

local budget_window = nil
local counters = nil
if any_budget then
  local HOUR, DAY = 3600000000, 86400000000
  -- Whole multiples of `len` at or below `t`, robust to the rounding of t / len.
  local function align(t, len)
    local s = mfloor(t / len) * len
    if s > t then
      s = s - len
    elseif s + len <= t then
      s = s + len
    end
    return s
  end
  local function days_from_civil(y, m)
    if m <= 2 then y = y - 1 end
    local era = mfloor(y / 400)
    local yoe = y - era * 400
    local mm
    if m > 2 then mm = m - 3 else mm = m + 9 end
    local doy = mfloor((153 * mm + 2) / 5)
    local doe = yoe * 365 + mfloor(yoe / 4) - mfloor(yoe / 100) + doy
    return era * 146097 + doe - 719468
  end
  -- The UTC calendar window [start, end) of budget period `code` that contains `t` (us);
  -- H. Hinnant's civil calendar, as in src/clock.rs (all values are small whole numbers).
  budget_window = function(code, t)
    if code == 1 then
      local s = align(t, HOUR)
      return s, s + HOUR
    elseif code == 2 then
      local s = align(t, DAY)
      return s, s + DAY
    end
    local z = align(t, DAY) / DAY + 719468
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
    return days_from_civil(y, m) * DAY, days_from_civil(ny, nm) * DAY
  end
  -- Budget counters of the levels with budgets: flat (period, start, used) runs.
  counters = {}
  for i = 1, leaf do
    local at = lv[16 * (i - 1) + 7]
    if at > 0 and a[at] > 0 then
      local nb = st[i][16]
      if nb > 0 then
        local bl = { sunpack(ssub(DS, 1, 3 * nb + 1), raws[i], 201) }
        bl[3 * nb + 1] = nil
        counters[i] = bl
      else
        counters[i] = {}
      end
    end
  end
end

local fails = nil

-- 4. Budgets: every matching calendar window must have room.
if counters then
  local PERIOD_NAMES = { 'hour', 'day', 'month' }
  for i = 1, leaf do
    local bl = counters[i]
    if bl then
      local at = lv[16 * (i - 1) + 7]
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
          fails[#fails + 1] = { 2, i - 1, wait, bmax, used, stop, PERIOD_NAMES[code],
            mfloor((stop - start) / 1e6), wait }
        end
      end
    end
  end
end

-- 5. The draw, from the caller up to the tool. Takes per level: tk[3 * (idx - 1) + 1..3] =
-- floor, share, ceiling; or nil and where and why it failed.
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
    local o = 16 * (idx - 1)
    local of = lv[o + 1]
    local share, ceiling = s[4], s[5]
    local done = false
    if of > 0 then
      local covered = 0
      if share_first and idx > 1 then
        covered = share
        if ceiling < covered then covered = ceiling end
        if rem < covered then covered = rem end
        if 0 > covered then covered = 0 end
      end
      local x = rem - covered
      local floor = s[3]
      if floor < x then x = floor end
      local y = of - s[9]
      if y < x then x = y end
      if 0 > x then x = 0 end
      tk[3 * idx - 2] = x
      rem = rem - x
      done = rem <= EPS
    end
    if done then
      break
    end
    local threshold = 0
    local bk = 0
    if idx < leaf then
      bk = lv[o + 6] - lv[o + 28]
    end
    if idx < leaf and not own_chain then
      local room = lv[o + 13] - bk - rem
      if 0 > room then room = 0 end
      threshold = bk + child_threshold * room
    end
    local need = rem + threshold
    local window_cap
    if idx > 1 then
      window_cap = INF
    elseif threshold > 0 then
      window_cap = lv[o + 3] - bk
    else
      window_cap = lv[o + 3]
    end
    local bucket_ok = ceiling + EPS >= need
    local window_ok = s[8] + rem <= window_cap + EPS
    if not (bucket_ok and window_ok) then
      return nil, idx, need, rem, window_ok, window_cap
    end
    tk[3 * idx] = rem
    if idx > 1 then
      if share + EPS >= rem then
        tk[3 * idx - 1] = rem
      else
        own_chain = false
      end
      child_threshold = lv[o + 4]
    end
  end
  return tk
end

local tk, at_, need_, rem_, window_ok_, window_cap_ = draw(true)
if not tk then
  tk, at_, need_, rem_, window_ok_, window_cap_ = draw(false)
  if not tk then
    -- Why the floor-first path failed, and when it could pass.
    local function wait_for(x, need, rate, depth)
      if x + EPS >= need then
        return 0
      elseif need > depth + EPS or rate <= 0 then
        return INF
      end
      return (need - x) * period / rate
    end
    local s, o = st[at_], 16 * (at_ - 1)
    local wait = wait_for(s[5], need_, lv[o + 10], lv[o + 13])
    if not window_ok_ then
      local w
      if rem_ > window_cap_ + EPS then w = INF else w = next_window - now end
      if w > wait then wait = w end
    end
    local lf, ol = st[leaf], 16 * (leaf - 1)
    local lof = lv[ol + 1]
    if lof + EPS >= c then
      local fw = wait_for(lf[3], c, lv[ol + 8], lv[ol + 11])
      if lf[9] + c > lof + EPS then
        local w = next_window - now
        if w > fw then fw = w end
      end
      if fw < wait then wait = fw end
    end
    -- Not in the engine: a lower bound of the time any path could pass this level (the
    -- least it must draw here, once every floor at and below it is full; no borrowing bar),
    -- for the local refusal cache, which must never refuse a call Redis would admit.
    local sure_wait = 0
    local rem_lb = c
    for j = at_, leaf do
      rem_lb = rem_lb - lv[16 * (j - 1) + 1]
    end
    if rem_lb > EPS then
      -- A tenant's or instance's ceiling rate grows when other template callers stop
      -- counting: bound the wait with the most it can become (the fewest callers counted).
      local rate, depth = lv[o + 10], lv[o + 13]
      if at_ > 1 then
        local function ceiling_rate(p, spare_, total_weight)
          local share = 0
          if total_weight > 0 then share = spare_ * a[p + 2] / total_weight end
          local ceiling = a[p + 3] + share
          if a[p + 4] == 1 then ceiling = a[p + 5] end
          local r = ceiling - a[p + 6]
          if 0 > r then r = 0 end
          return r, ceiling
        end
        local n_t, n_i = 0, 0
        if t_template then n_t = 1 end
        if i_template then n_i = 1 end
        local r, t_ceiling_max = ceiling_rate(14, spare, a[7] + a[8] * n_t)
        local burst = a[22]
        if at_ == 3 then
          local inner_spare = t_ceiling_max - a[21]
          if 0 > inner_spare then inner_spare = 0 end
          r = ceiling_rate(29, inner_spare, a[25] + a[26] * n_i)
          burst = a[37]
        end
        if r > rate then
          rate, depth = r, burst
        end
      end
      sure_wait = wait_for(s[5], rem_lb, rate, depth)
      if at_ == 1 and s[8] + rem_lb > lv[3] + EPS then
        local w = next_window - now
        if w > sure_wait then sure_wait = w end
      end
    end
    if wait < sure_wait then sure_wait = wait end
    fails = fails or {}
    fails[#fails + 1] = { 1, at_ - 1, wait, lv[o + 2], s[7], nil, '', nil, sure_wait }
  end
end

if fails then
  local worst = fails[1]
  local sure_wait = worst[9]
  for i = 2, #fails do
    if fails[i][3] > worst[3] then
      worst = fails[i]
    end
    if fails[i][9] > sure_wait then sure_wait = fails[i][9] end
  end
  return refuse(worst[1], worst[2], worst[3], worst[4], worst[5], worst[6], worst[7], worst[8],
    sure_wait)
end

-- 6. Commit.
local track_until = mceil(now + period)
if t_template then s2[11] = track_until end
if i_template then s3[11] = track_until end
local floor_units = 0
for i = 1, leaf do
  local s = st[i]
  local o = 3 * i
  local fl, h, k = tk[o - 2], tk[o - 1], tk[o]
  floor_units = floor_units + fl
  s[3], s[4], s[5] = s[3] - fl, s[4] - h, s[5] - k
  s[7], s[8], s[9] = s[7] + c, s[8] + k, s[9] + fl
  if lv[16 * (i - 1) + 5] >= 0 then
    -- The call's permit: an entry that lapses by itself (expired ones are pruned here).
    local pk = KEYS[5 + i]
    rcall('ZREMRANGEBYSCORE', pk, '-inf', now_s)
    rcall('ZADD', pk, string.format('%.17g', now + a[12] * 1000), ARGV[2])
    rcall('PEXPIRE', pk, a[12])
    s[10] = flight[i] + 1
  else
    s[10] = 0
  end
  local bl = counters and counters[i]
  if bl then
    local at = lv[16 * (i - 1) + 7]
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
    s[16] = #bl / 3
  end
end
s1[9] = s1[9] + (floor_units - tk[1])

-- Trackers: a new member joins; the zset lives as long as its latest member (set a little
-- ahead, up to 1/16 of a period, so a busy tracker's TTL is not set on every call).
if (t_template and (not tenant_tracked or track_until > s1[15]))
    or (i_template and (not instance_tracked or track_until > s2[15])) then
  local function track(zkey, ps, member, tracked)
    if not tracked then
      ps[13] = ps[13] + rcall('ZADD', zkey, track_until, member)
      if track_until < ps[14] then ps[14] = track_until end
    end
    if not tracked or track_until > ps[15] then
      local zexp = track_until
      if ps[15] > now then
        local q = period / 16
        zexp = mceil(track_until / q) * q
      end
      local ms = mceil((zexp - now) / 1000)
      if ms < 1 then ms = 1 end
      rcall('PEXPIRE', zkey, ms)
      ps[15] = zexp
    end
  end
  if t_template then track(KEYS[2], s1, KEYS[3], tenant_tracked) end
  if i_template then track(KEYS[4], s2, KEYS[5], instance_tracked) end
end

local permit_ttl = a[12]
for i = 1, leaf do
  local s, o = st[i], 16 * (i - 1)
  local rf, rh, rk, df, dh, dk = lv[o + 8], lv[o + 9], lv[o + 10], lv[o + 11], lv[o + 12], lv[o + 13]
  -- When the state is equivalent to a fresh one, from its own clock (engine::expiry).
  local t, floor, share, ceiling, total = s[2], s[3], s[4], s[5], s[7]
  local at = t
  if rf > 0 and floor < df then
    local v = t + (df - floor) * period / rf
    if v > at then at = v end
  end
  if rh > 0 and share < dh then
    local v = t + (dh - share) * period / rh
    if v > at then at = v end
  end
  if rk > 0 and ceiling < dk then
    local v = t + (dk - ceiling) * period / rk
    if v > at then at = v end
  end
  if total > 0 then
    local v = (s[6] + 1) * period
    if v > at then at = v end
  end
  local bl = counters and counters[i]
  local tail = ''
  if bl then
    for x = 1, #bl, 3 do
      if bl[x + 2] > 0 then
        local _, e = budget_window(bl[x], bl[x + 1])
        if e > at then at = e end
      end
    end
    if #bl > 0 then tail = spack(ssub(DS, 1, #bl + 1), unpack(bl)) end
  elseif s[16] > 0 then
    -- Counters no budget of the plan names: carried over as they are.
    for x = 0, s[16] - 1 do
      local code, start, used = sunpack('<ddd', raws[i], 201 + 24 * x)
      if used > 0 then
        local _, e = budget_window(code, start)
        if e > at then at = e end
      end
    end
    tail = ssub(raws[i], 201)
  end
  if now > at then at = now end
  -- The TTL: until the state is fresh and, for a tracked template child, its `until`.
  local keep = at
  if s[11] > keep then keep = s[11] end
  local ttl = mceil((keep - now) / 1000)
  if ttl < 1 then ttl = 1 end
  local deadline = rms + ttl
  if s[10] > 0 and ttl < permit_ttl then
    ttl = permit_ttl
    keep = now + permit_ttl * 1000
  end
  -- Setting a TTL costs: keep the key's own while it lasts long enough, and when it must
  -- grow, set it a little ahead (up to 1/16 of a period) so a busy key is not re-timed on
  -- every call. A new key gets exactly what it needs.
  local raw = raws[i]
  if raw and s[12] >= keep then
    rcall('SET', KEYS[2 * i - 1], spack(FULL, MARK, t, floor, share, ceiling, s[6], total, s[8],
      s[9], s[10], s[11], s[12], s[13], s[14], s[15], s[16], at, deadline, rf, rh, rk, df, dh,
      dk, period) .. tail, 'KEEPTTL')
  else
    if raw then
      local q = period / 16
      keep = mceil(keep / q) * q
      ttl = mceil((keep - now) / 1000)
    end
    rcall('SET', KEYS[2 * i - 1], spack(FULL, MARK, t, floor, share, ceiling, s[6], total, s[8],
      s[9], s[10], s[11], keep, s[13], s[14], s[15], s[16], at, deadline, rf, rh, rk, df, dh,
      dk, period) .. tail, 'PX', ttl)
  end
end

local lf, ol = st[leaf], 16 * (leaf - 1)
local remaining = lv[ol + 1] - lf[9]
if lf[3] < remaining then remaining = lf[3] end
if 0 > remaining then remaining = 0 end
local non_floor_room = INF
for i = 1, leaf do
  local s = st[i]
  local room = s[5]
  local y = lv[16 * (i - 1) + 3] - s[8]
  if y < room then room = y end
  if 0 > room then room = 0 end
  if room < non_floor_room then non_floor_room = room end
end
remaining = remaining + non_floor_room

return { 1, spack('<ddddddddddddddddddddddd', now, remaining, s1[5], n_tenants, n_instances,
  tk[1], tk[2], tk[3], tk[4], tk[5], tk[6], tk[7], tk[8], tk[9],
  lv[11], lv[12], lv[13], lv[27], lv[28], lv[29], lv[43], lv[44], lv[45]) }
