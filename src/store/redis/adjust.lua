-- tower-fairshare: correct an admitted call's charge by `factor` x what it charged
-- (engine::adjust), at every level it charged.
--
-- KEYS: the state keys of the charged levels.
-- ARGV: 1 packed doubles: now (-1: Redis TIME), factor, cost, window, permit TTL (ms), then per
--       key: level (0 tool, 1 tenant, 2 instance), floor, floor_depth, share, share_depth,
--       ceiling, ceiling_depth, nb, nb x (period_code start).
local nxt = argv_reader()
local now = now_from(nxt())
local factor = nxt()
local cost = nxt()
local window = nxt()
local permit_ttl = nxt()

local function give(x, amount, depth)
  local y = x - amount * factor
  if factor < 0 then
    return math.min(y, math.max(depth, x))
  end
  return y
end

for _, key in ipairs(KEYS) do
  local level = nxt()
  local lc = { floor = nxt(), floor_depth = nxt(), share = nxt(), share_depth = nxt(),
    ceiling = nxt(), ceiling_depth = nxt(), budgets = {} }
  local nb = nxt()
  for i = 1, nb do
    lc.budgets[i] = { period = nxt(), start = nxt() }
  end
  local s = load_state(key)
  if s.live then
    s.floor = give(s.floor, lc.floor, lc.floor_depth)
    s.share = give(s.share, lc.share, lc.share_depth)
    s.ceiling = give(s.ceiling, lc.ceiling, lc.ceiling_depth)
    if s.window == window then
      local delta = cost * factor
      s.total = math.max(s.total + delta, 0)
      s.non_floor = math.max(s.non_floor + lc.ceiling * factor, 0)
      local floor_delta
      if level == 0 then
        floor_delta = (cost - lc.ceiling) * factor
      else
        floor_delta = lc.floor * factor
      end
      s.floor_used = math.max(s.floor_used + floor_delta, 0)
    end
    for _, cb in ipairs(lc.budgets) do
      if budget_window(cb.period, now) == cb.start then
        for _, b in ipairs(s.budgets) do
          if b.period == cb.period and b.start == cb.start then
            b.used = math.max(b.used + cost * factor, 0)
            break
          end
        end
      end
    end
    -- A bigger charge may keep the state meaningful for longer: never let the TTL fall short.
    local pttl = redis.call('PTTL', key)
    s.expires = expiry_of(s, now)
    local ttl = ttl_ms(math.max(s.expires, s.track_until), now)
    if s.in_flight > 0 and ttl < permit_ttl then
      ttl = permit_ttl
    end
    if ttl > pttl then
      save_state(key, s, now, permit_ttl)
    else
      s.deadline = math.max(s.deadline, redis_ms() + ttl_ms(math.max(s.expires, s.track_until), now))
      redis.call('SET', key, encode_state(s), 'KEEPTTL')
    end
  end
end
return 1
