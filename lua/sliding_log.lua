-- Sliding-window log (between lua/head.lua and lua/tail.lua). A counted rule's key is a sorted set
-- of admissions, one member per unit, scored by time (ms). An admission at t counts while
-- t + period > now, as in the in-memory store; a log never holds more than its rule's limit of
-- members. Reservations (a max delay) are admissions scored in the future.
-- A request of cost 0 adds nothing, but still gets the key's expiry.

local function inspect(i, limit, period)
  local key = KEYS[i]
  call('ZREMRANGEBYSCORE', key, '-inf', text_of(now - period))
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

local function commit(state, at)
  log_admit(state.key, at, state.count, cost, state.period)
  state.count = state.count + cost
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
