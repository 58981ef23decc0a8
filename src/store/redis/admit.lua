-- tower-fairshare: one whole admission decision, atomically. Mirrors
-- src/admission/engine.rs `decide` operation for operation, in the same f64 arithmetic.
--
-- KEYS: 1 tool state, 2 tool's tracker of template tenants, 3 tenant state,
--       4 tenant's tracker of template instances, 5 instance state (when there is one).
-- ARGV: 1 the plan, packed doubles (see `encode_plan` in mod.rs).
-- Returns {1, admission} or {0, refusal, window label}, numbers packed as doubles.

local nxt = argv_reader()

local now = now_from(nxt())
local c = nxt()
local period = nxt()
local spare = nxt()
local capacity = nxt()
local tool_burst = nxt()
local configured_weight = nxt()
local default_tenant_weight = nxt()
local configured_tenant_burst = nxt()
local default_tenant_burst = nxt()
local tool_cap = nxt()
if tool_cap < 0 then
  tool_cap = nil
end
local permit_ttl = nxt()
local has_instance = nxt() == 1

local function read_level()
  local p = {}
  p.template = nxt() == 1
  p.max_tracked = nxt()
  p.weight = nxt()
  p.floor = nxt()
  local has_ceiling = nxt() == 1
  local ceiling = nxt()
  if has_ceiling then p.ceiling = ceiling end
  p.reserved_floor = nxt()
  p.children_floor = nxt()
  p.burst = nxt()
  p.borrow_threshold = nxt()
  local cap = nxt()
  if cap >= 0 then p.max_concurrency = cap end
  p.configured_child_weight = nxt()
  p.default_child_weight = nxt()
  p.configured_child_burst = nxt()
  p.default_child_burst = nxt()
  nxt()
  return p
end

local t_pol = read_level()
local i_pol = nil
if has_instance then
  i_pol = read_level()
end

local function read_budgets()
  local list = {}
  local n = nxt()
  for i = 1, n do
    list[i] = { period = nxt(), max = nxt() }
  end
  return list
end
local budget_lists = { read_budgets(), read_budgets(), {} }
if has_instance then
  budget_lists[3] = read_budgets()
end

local window = math.floor(now / period)
local next_window = (window + 1) * period

local PERIOD_NAMES = { 'hour', 'day', 'month' }

local function refuse(f)
  local reset, has_reset = 0, 0
  if f.reset_at then
    reset, has_reset = f.reset_at, 1
  end
  return { 0, struct.pack('<dddddddd', now, f.reason, f.scope, f.wait, f.limit, f.used, has_reset,
    reset) .. struct.pack('<dd', f.window_secs or -1, f.sure_wait or 0), f.window }
end

-- 1. Tracked template callers: a flood of new identities stops here.
local n_tenants = 0
local tenant_tracked = false
if t_pol.template then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  n_tenants = redis.call('ZCARD', KEYS[2])
  tenant_tracked = redis.call('ZSCORE', KEYS[2], KEYS[3]) ~= false
  if not tenant_tracked then
    if n_tenants >= t_pol.max_tracked then
      return refuse({ reason = 2, scope = 1, wait = period, window = 'callers',
        limit = t_pol.max_tracked, used = n_tenants })
    end
    n_tenants = n_tenants + 1
  end
end
local n_instances = 0
if has_instance and i_pol.template then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  n_instances = redis.call('ZCARD', KEYS[4])
  local tracked = redis.call('ZSCORE', KEYS[4], KEYS[5]) ~= false
  if not tracked then
    if n_instances >= i_pol.max_tracked then
      return refuse({ reason = 2, scope = 2, wait = period, window = 'callers',
        limit = i_pol.max_tracked, used = n_instances })
    end
    n_instances = n_instances + 1
  end
end

-- 2. The numbers each level is owed right now (policy/numbers.rs `level_numbers`).
local function level_numbers(p, spare_, total_weight)
  local share = 0
  if total_weight > 0 then
    share = spare_ * p.weight / total_weight
  end
  local nominal = p.floor + share
  local ceiling = p.ceiling or nominal
  local reserved = p.reserved_floor
  return {
    weight = p.weight,
    floor = p.floor,
    own_floor = math.max(reserved - p.children_floor, 0),
    share = share,
    ceiling = ceiling,
    share_rate = math.max(nominal - reserved, 0),
    ceiling_rate = math.max(ceiling - reserved, 0),
  }
end

local function bucket(rate, depth)
  rate = math.max(rate, 0)
  if rate <= 0 then
    depth = 0
  end
  return { rate = rate, depth = depth }
end

local tn = level_numbers(t_pol, spare, configured_weight + default_tenant_weight * n_tenants)
local levels = {}
levels[1] = {
  scope = 0, key = KEYS[1], cap = tool_cap,
  numbers = { weight = 0, floor = 0, own_floor = 0, share = spare, ceiling = capacity,
    share_rate = 0, ceiling_rate = spare },
  floor_b = bucket(0, 0), share_b = bucket(0, 0), ceil_b = bucket(spare, tool_burst),
  state = load_state(KEYS[1]),
}
levels[2] = {
  scope = 1, key = KEYS[3], cap = t_pol.max_concurrency, policy = t_pol, numbers = tn,
  floor_b = bucket(tn.own_floor, tn.own_floor), share_b = bucket(tn.share_rate, t_pol.burst),
  ceil_b = bucket(tn.ceiling_rate, t_pol.burst), state = load_state(KEYS[3]),
}
if has_instance then
  local inner_spare = math.max(tn.ceiling - t_pol.children_floor, 0)
  local inner_weight = t_pol.configured_child_weight + t_pol.default_child_weight * n_instances
  local inn = level_numbers(i_pol, inner_spare, inner_weight)
  levels[3] = {
    scope = 2, key = KEYS[5], cap = i_pol.max_concurrency, policy = i_pol, numbers = inn,
    floor_b = bucket(inn.own_floor, inn.own_floor), share_b = bucket(inn.share_rate, i_pol.burst),
    ceil_b = bucket(inn.ceiling_rate, i_pol.burst), state = load_state(KEYS[5]),
  }
end
local banks = {
  configured_tenant_burst + default_tenant_burst * n_tenants,
  t_pol.configured_child_burst + t_pol.default_child_burst * n_instances,
  0,
}
for _, l in ipairs(levels) do
  local s, f, h, k = l.state, l.floor_b, l.share_b, l.ceil_b
  if not s.live then
    s.live = true
    s.t = now
    s.floor = f.depth
    s.share = h.depth
    s.ceiling = k.depth
  else
    local dt = math.max(now - s.t, 0)
    s.floor = math.min(s.floor + dt * f.rate / period, f.depth)
    s.share = math.min(s.share + dt * h.rate / period, h.depth)
    s.ceiling = math.min(s.ceiling + dt * k.rate / period, k.depth)
    if now > s.t then
      s.t = now
    end
  end
  if s.window ~= window then
    s.window = window
    s.total = 0
    s.non_floor = 0
    s.floor_used = 0
  end
end

-- 3. Concurrency, before any rate is looked at.
for _, l in ipairs(levels) do
  if l.cap and l.state.in_flight + 1 > l.cap then
    return refuse({ reason = 3, scope = l.scope, wait = 1000000, window = 'in_flight',
      limit = l.cap, used = l.state.in_flight })
  end
end

local fails = {}

-- 4. Budgets: every matching calendar window must have room.
for idx, l in ipairs(levels) do
  for _, b in ipairs(budget_lists[idx]) do
    local start, stop = budget_window(b.period, now)
    local used = 0
    for _, x in ipairs(l.state.budgets) do
      if x.period == b.period and x.start == start then
        used = x.used
        break
      end
    end
    if used + c > b.max + EPS then
      local wait
      if c > b.max + EPS then wait = INF else wait = stop - now end
      fails[#fails + 1] = { reason = 2, scope = l.scope, wait = wait,
        window = PERIOD_NAMES[b.period], limit = b.max, used = used, reset_at = stop,
        window_secs = math.floor((stop - start) / 1e6), sure_wait = wait }
    end
  end
end

-- 5. The draw, from the caller up to the tool.
local leaf = #levels

local function wait_for(x, need, b)
  if x + EPS >= need then
    return 0
  elseif need > b.depth + EPS or b.rate <= 0 then
    return INF
  end
  return (need - x) * period / b.rate
end

local function fail(at, need, rem, window_ok, window_cap)
  local l = levels[at]
  local s = l.state
  local wait = wait_for(s.ceiling, need, l.ceil_b)
  if not window_ok then
    local w
    if rem > window_cap + EPS then w = INF else w = next_window - now end
    wait = math.max(wait, w)
  end
  local lf = levels[leaf]
  if lf.numbers.own_floor + EPS >= c then
    local fw = wait_for(lf.state.floor, c, lf.floor_b)
    if lf.state.floor_used + c > lf.numbers.own_floor + EPS then
      fw = math.max(fw, next_window - now)
    end
    wait = math.min(wait, fw)
  end
  -- Not in the engine: a lower bound of the time any path could pass this level (the least
  -- it must draw here, once every floor at and below it is full; no borrowing bar), for the
  -- local refusal cache, which must never refuse a call Redis would admit.
  local sure_wait = 0
  local rem_lb = c
  for j = at, leaf do
    rem_lb = rem_lb - levels[j].numbers.own_floor
  end
  if rem_lb > EPS then
    sure_wait = wait_for(s.ceiling, rem_lb, l.ceil_b)
    if at == 1 and s.non_floor + rem_lb > l.numbers.ceiling_rate + EPS then
      sure_wait = math.max(sure_wait, next_window - now)
    end
  end
  return { reason = 1, scope = l.scope, wait = wait, window = '', limit = l.numbers.ceiling,
    used = s.total, sure_wait = math.min(sure_wait, wait) }
end

local function draw(share_first)
  local takes = { { 0, 0, 0 }, { 0, 0, 0 }, { 0, 0, 0 } }
  local rem = c
  local own_chain = true
  local child_threshold = 0.5
  for idx = leaf, 1, -1 do
    if rem <= EPS then
      break
    end
    local l = levels[idx]
    local s = l.state
    local own_floor = l.numbers.own_floor
    local done = false
    if own_floor > 0 then
      local covered = 0
      if share_first and idx > 1 then
        covered = math.max(math.min(math.min(s.share, s.ceiling), rem), 0)
      end
      local x = math.max(math.min(math.min(rem - covered, s.floor), own_floor - s.floor_used), 0)
      takes[idx][1] = x
      rem = rem - x
      done = rem <= EPS
    end
    if done then
      break
    end
    local threshold = 0
    if idx < leaf and not own_chain then
      local bk = banks[idx]
      threshold = bk + child_threshold * math.max(l.ceil_b.depth - bk - rem, 0)
    end
    local need = rem + threshold
    local window_cap
    if idx > 1 then
      window_cap = INF
    elseif threshold > 0 then
      window_cap = l.numbers.ceiling_rate - banks[idx]
    else
      window_cap = l.numbers.ceiling_rate
    end
    local bucket_ok = s.ceiling + EPS >= need
    local window_ok = s.non_floor + rem <= window_cap + EPS
    if not (bucket_ok and window_ok) then
      return nil, fail(idx, need, rem, window_ok, window_cap)
    end
    takes[idx][3] = rem
    if idx > 1 then
      if s.share + EPS >= rem then
        takes[idx][2] = rem
      else
        own_chain = false
      end
      child_threshold = l.policy.borrow_threshold
    end
  end
  return takes
end

local takes, f = draw(true)
if not takes then
  takes, f = draw(false)
  if not takes then
    fails[#fails + 1] = f
  end
end

if #fails > 0 then
  local worst = fails[1]
  local sure_wait = fails[1].sure_wait
  for i = 2, #fails do
    if fails[i].wait > worst.wait then
      worst = fails[i]
    end
    sure_wait = math.max(sure_wait, fails[i].sure_wait)
  end
  worst.sure_wait = sure_wait
  return refuse(worst)
end

-- 6. Commit.
local out = {}
local charges = {}
local floor_units = 0
for idx, l in ipairs(levels) do
  local tk = takes[idx]
  local fl, h, k = tk[1], tk[2], tk[3]
  floor_units = floor_units + fl
  local s = l.state
  s.floor = s.floor - fl
  s.share = s.share - h
  s.ceiling = s.ceiling - k
  s.total = s.total + c
  s.non_floor = s.non_floor + k
  s.floor_used = s.floor_used + fl
  local permit = l.cap ~= nil
  if permit then
    s.in_flight = s.in_flight + 1
  end
  local charged = {}
  for _, b in ipairs(budget_lists[idx]) do
    local start = budget_window(b.period, now)
    local found = nil
    for _, x in ipairs(s.budgets) do
      if x.period == b.period then
        found = x
        break
      end
    end
    if found and found.start == start then
      found.used = found.used + c
    elseif found then
      found.start = start
      found.used = c
    else
      s.budgets[#s.budgets + 1] = { period = b.period, start = start, used = c }
    end
    charged[#charged + 1] = { b.period, start }
  end
  local pm = 0
  if permit then pm = 1 end
  charges[idx] = { fl, l.floor_b.depth, h, l.share_b.depth, k, l.ceil_b.depth, pm, charged }
end
levels[1].state.floor_used = levels[1].state.floor_used + (floor_units - takes[1][1])

for _, l in ipairs(levels) do
  local s = l.state
  s.rate_f, s.rate_h, s.rate_k = l.floor_b.rate, l.share_b.rate, l.ceil_b.rate
  s.depth_f, s.depth_h, s.depth_k = l.floor_b.depth, l.share_b.depth, l.ceil_b.depth
  s.period = period
  s.expires = expiry_of(s, now)
  save_state(l.key, s, now, permit_ttl)
end
local track_until = math.ceil(now + period)
local track_ttl = ttl_ms(track_until, now)
if t_pol.template then
  redis.call('ZADD', KEYS[2], track_until, KEYS[3])
  redis.call('PEXPIRE', KEYS[2], track_ttl)
end
if has_instance and i_pol.template then
  redis.call('ZADD', KEYS[4], track_until, KEYS[5])
  redis.call('PEXPIRE', KEYS[4], track_ttl)
end

local lf = levels[leaf]
local remaining = math.max(math.min(lf.numbers.own_floor - lf.state.floor_used, lf.state.floor), 0)
local non_floor_room = INF
for _, l in ipairs(levels) do
  local room = math.max(math.min(l.state.ceiling, l.numbers.ceiling_rate - l.state.non_floor), 0)
  non_floor_room = math.min(non_floor_room, room)
end
remaining = remaining + non_floor_room

out[#out + 1] = now
out[#out + 1] = remaining
out[#out + 1] = lf.numbers.ceiling
out[#out + 1] = next_window - now
out[#out + 1] = levels[1].state.ceiling
for idx = 2, 3 do
  local l = levels[idx]
  if l then
    out[#out + 1] = l.numbers.weight
    out[#out + 1] = l.numbers.floor
    out[#out + 1] = l.numbers.share
    out[#out + 1] = l.numbers.ceiling
  else
    for _ = 1, 4 do out[#out + 1] = 0 end
  end
end
out[#out + 1] = window
for idx = 1, 3 do
  local ch = charges[idx]
  if ch then
    out[#out + 1] = 1
    for j = 1, 7 do out[#out + 1] = ch[j] end
    out[#out + 1] = #ch[8]
    for _, b in ipairs(ch[8]) do
      out[#out + 1] = b[1]
      out[#out + 1] = b[2]
    end
  else
    out[#out + 1] = 0
  end
end
return { 1, struct.pack('<' .. string.rep('d', #out), unpack(out)) }
