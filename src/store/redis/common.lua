-- tower-fairshare: helpers shared by the adjust, release and sweep scripts (prepended to each;
-- admit.lua is standalone, for speed, and reads and writes the same layout).
--
-- Numbers travel as little-endian IEEE doubles (struct 'd'), never as text: Lua numbers are
-- doubles, so every value round-trips bit for bit between Rust, Lua and Redis.
--
-- A level's state is one string key of doubles (the layout is described at the top of
-- admit.lua, which reads and writes it the same way):
--   mark (-2: this layout; anything else reads as absent)
--   t floor share ceiling window total non_floor floor_used in_flight   (the engine's NodeState)
--   track_until key_until child_count child_low child_zexp nb           (trackers, TTL, budgets)
--   expires deadline rate_f rate_h rate_k depth_f depth_h depth_k period (to recompute expiry)
--   nb x (period_code start used)                                       (budget counters)
-- Budget period codes: 1 hour, 2 day, 3 month.

local EPS = 1e-9
local INF = math.huge
local HOUR = 3600000000
local DAY = 86400000000
local HEADER = 25
local HEADER_FORMAT = '<' .. string.rep('d', HEADER)
local MARK = -2

-- Redis's clock in µs, read once per script (every redis.call costs inside Redis).
local redis_now_us = nil
local function redis_us()
  if not redis_now_us then
    local t = redis.call('TIME')
    redis_now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return redis_now_us
end

-- Redis's own clock in ms (TTLs run on it whatever clock the decisions use).
local function redis_ms()
  return math.floor(redis_us() / 1000)
end

-- ARGV[1] is a run of packed little-endian doubles; the reader hands them out in order.
local function argv_reader()
  local p = { struct.unpack('<' .. string.rep('d', #ARGV[1] / 8), ARGV[1]) }
  local i = 0
  return function()
    i = i + 1
    return p[i]
  end
end

local function now_from(arg)
  if arg >= 0 then
    return arg
  end
  return redis_us()
end

-- H. Hinnant's civil calendar, as in src/clock.rs (all values are small whole numbers).
local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m
  if mp < 10 then m = mp + 3 else m = mp - 9 end
  if m <= 2 then y = y + 1 end
  return y, m, d
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mm
  if m > 2 then mm = m - 3 else mm = m + 9 end
  local doy = math.floor((153 * mm + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

-- Whole multiples of `len` at or below `t`, robust to the rounding of t / len.
local function align(t, len)
  local s = math.floor(t / len) * len
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
  local days = align(t, DAY) / DAY
  local y, m = civil_from_days(days)
  local ny, nm = y, m + 1
  if m == 12 then
    ny, nm = y + 1, 1
  end
  return days_from_civil(y, m, 1) * DAY, days_from_civil(ny, nm, 1) * DAY
end

local function fresh_state()
  return {
    live = false, t = 0, floor = 0, share = 0, ceiling = 0, window = 0, total = 0,
    non_floor = 0, floor_used = 0, in_flight = 0, expires = 0,
    rate_f = 0, rate_h = 0, rate_k = 0, depth_f = 0, depth_h = 0, depth_k = 0, period = 1,
    deadline = 0, track_until = 0, child_count = 0, child_low = 0, child_zexp = 0, key_until = 0,
    budgets = {},
  }
end

-- A state written by another layout (no mark) reads as absent: it is never misread.
local function load_state(key)
  local raw = redis.call('GET', key)
  local s = fresh_state()
  if not raw or #raw < HEADER * 8 then
    return s
  end
  local v = { struct.unpack(HEADER_FORMAT, raw) }
  if v[1] ~= MARK then
    return s
  end
  s.live = true
  s.t, s.floor, s.share, s.ceiling, s.window = v[2], v[3], v[4], v[5], v[6]
  s.total, s.non_floor, s.floor_used, s.in_flight = v[7], v[8], v[9], v[10]
  s.track_until, s.key_until, s.child_count, s.child_low, s.child_zexp = v[11], v[12], v[13], v[14], v[15]
  s.expires, s.deadline, s.rate_f, s.rate_h, s.rate_k = v[17], v[18], v[19], v[20], v[21]
  s.depth_f, s.depth_h, s.depth_k, s.period = v[22], v[23], v[24], v[25]
  local nb = v[16]
  if nb > 0 then
    local b = { struct.unpack('<' .. string.rep('d', 3 * nb), raw, HEADER * 8 + 1) }
    for i = 0, nb - 1 do
      s.budgets[i + 1] = { period = b[3 * i + 1], start = b[3 * i + 2], used = b[3 * i + 3] }
    end
  end
  return s
end

local function encode_state(s)
  local out = {
    MARK, s.t, s.floor, s.share, s.ceiling, s.window, s.total, s.non_floor, s.floor_used,
    s.in_flight, s.track_until, s.key_until, s.child_count, s.child_low, s.child_zexp,
    #s.budgets, s.expires, s.deadline, s.rate_f, s.rate_h, s.rate_k, s.depth_f, s.depth_h,
    s.depth_k, s.period,
  }
  for _, b in ipairs(s.budgets) do
    out[#out + 1] = b.period
    out[#out + 1] = b.start
    out[#out + 1] = b.used
  end
  return struct.pack('<' .. string.rep('d', #out), unpack(out))
end

-- Milliseconds from `now` until `at`, rounded up, at least 1 (a TTL).
local function ttl_ms(at, now)
  local ms = math.ceil((at - now) / 1000)
  if ms < 1 then
    ms = 1
  end
  return ms
end

-- When a state is equivalent to a fresh one, from its own clock `s.t` (engine::expiry).
local function expiry_of(s, now)
  local at = s.t
  local pairs_ = { { s.floor, s.rate_f, s.depth_f }, { s.share, s.rate_h, s.depth_h }, { s.ceiling, s.rate_k, s.depth_k } }
  for _, p in ipairs(pairs_) do
    local x, rate, depth = p[1], p[2], p[3]
    if rate > 0 and x < depth then
      at = math.max(at, s.t + (depth - x) * s.period / rate)
    end
  end
  if s.total > 0 then
    at = math.max(at, (s.window + 1) * s.period)
  end
  for _, b in ipairs(s.budgets) do
    if b.used > 0 then
      local _, e = budget_window(b.period, b.start)
      at = math.max(at, e)
    end
  end
  return math.max(at, now)
end

-- Writes a state with its TTL: until `expires` (in the decisions' clock, from `now`), and at
-- least `permit_ttl` ms while it holds permits. Remembers the permit-free deadline in Redis's
-- clock, so the last release can bring the TTL back to it.
local function save_state(key, s, now, permit_ttl)
  local ttl = ttl_ms(math.max(s.expires, s.track_until), now)
  s.deadline = redis_ms() + ttl
  if s.in_flight > 0 and ttl < permit_ttl then
    ttl = permit_ttl
  end
  s.key_until = now + ttl * 1000
  redis.call('SET', key, encode_state(s), 'PX', ttl)
end
