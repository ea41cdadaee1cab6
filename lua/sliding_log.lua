-- Sliding-window log (between lua/head.lua and lua/tail.lua). A counted rule's key is a sorted set
-- of admissions, one member per unit, scored by time (ms). An admission at t counts while
-- t + period > now, as in the in-memory store; a log never holds more than its rule's limit of
-- members. Reservations (ARGV[3] > 0) are admissions scored in the future.

-- The score of the n-th oldest admission (1-based), or nil.
local function nth_oldest(key, n)
  local found = call('ZRANGE', key, n - 1, n - 1, 'WITHSCORES')
  return tonumber(found[2])
end

local function inspect(i, limit, period)
  local key = KEYS[i]
  call('ZREMRANGEBYSCORE', key, '-inf', now - period)
  local count = call('ZCARD', key)
  return {key = key, limit = limit, period = period, count = count, fits = count + cost <= limit}
end

local function wait(state)
  if cost > state.limit then
    return nil
  end
  -- The request fits once `count + cost - limit` of the oldest admissions leave the window.
  return nth_oldest(state.key, state.count + cost - state.limit) + state.period - now
end

-- ZADD takes members in batches, so a costly request never overflows Lua's stack with unpack.
local BATCH = 1000

local function commit(state, at)
  -- Members are unique per score: a suffix numbering the units recorded at that time. Without
  -- reservations every member at `now` was added at `now`, when the count only grows, so the count
  -- numbers them; reservations can come back to a time after older members left, so count anew.
  local numbered = state.count
  if max_delay > 0 then
    numbered = call('ZCOUNT', state.key, at, at)
  end
  local unit = 0
  while unit < cost do
    local members = {}
    for _ = 1, math.min(BATCH, cost - unit) do
      unit = unit + 1
      members[#members + 1] = at
      members[#members + 1] = at .. '-' .. (numbered + unit)
    end
    call('ZADD', state.key, unpack(members))
  end
  state.count = state.count + cost
  -- The expiry comes with the write: the newest admission leaves the window one period after it.
  -- A request that fits now may be recorded before earlier reservations.
  local newest = at
  if max_delay > 0 then
    newest = math.max(at, tonumber(call('ZRANGE', state.key, -1, -1, 'WITHSCORES')[2]))
  end
  call('PEXPIREAT', state.key, newest + state.period)
end

local function undo()
end

local function report(state)
  local oldest = nth_oldest(state.key, 1)
  local reset = 0
  if oldest then
    reset = oldest + state.period - now
  end
  return math.max(state.limit - state.count, 0), reset
end
