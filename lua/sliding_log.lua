-- Sliding-window log (between lua/head.lua and lua/tail.lua). A counted rule's key is a sorted set
-- of admissions, one member per request whatever its cost, scored by time (ms) and numbering its
-- units (see lua/common.lua). An admission at t counts while t + period > now, as in the in-memory
-- store; a log never holds more than its rule's limit of units. Reservations (a max delay) are
-- admissions scored in the future.
-- A request of cost 0 adds nothing, but still gets the key's expiry.

local function inspect(i, limit, period)
  local key = KEYS[i]
  local log
  if peek then
    log = log_read_after(key, now - period)
  else
    call('ZREMRANGEBYSCORE', key, '-inf', text_of(now - period))
    log = log_read(key)
  end
  return {key = key, limit = limit, period = period, log = log, fits = log.count + cost <= limit}
end

local function wait(state)
  if cost > state.limit then
    return nil
  end
  -- The request fits once `count + cost - limit` of the oldest units leave the window.
  return log_unit_at(state.key, state.log, state.log.count + cost - state.limit) + state.period
    - now
end

local function commit(state, at)
  log_admit(state.key, at, state.log, cost, state.period)
end

local function give_back(i, _, period)
  local key = KEYS[i]
  call('ZREMRANGEBYSCORE', key, '-inf', text_of(now - period))
  if giving_back then
    log_give_back(key, cost, admitted_at)
    return
  end
  local left = cost
  while left > 0 do
    local found = call('ZRANGE', key, -1, -1, 'WITHSCORES')
    if found[1] == nil then
      break
    end
    local first, units = string.match(found[1], '^%a(%d+):(%d+)$')
    first, units = tonumber(first), tonumber(units)
    if units > left then
      -- Smaller, under a name of its own; added before the old one goes, so the key (and its
      -- expiry) never lapses.
      call('ZADD', key, found[2], log_name(first, units - left))
      left = 0
    else
      left = left - units
    end
    call('ZREM', key, found[1])
  end
end

local function undo()
end

local function report(state)
  local reset = 0
  if state.log.oldest then
    reset = state.log.oldest + state.period - now
  end
  return math.max(state.limit - state.log.count, 0), reset
end
