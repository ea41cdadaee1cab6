-- Sliding-window counter (between lua/head.lua and lua/tail.lua). A counted rule's key is a hash
-- {s = start of the current window (ms), c = its count, p = the previous window's count}; windows
-- are aligned to the epoch, as in the in-memory store.
--
-- used = floor(previous * weight / 65536) + current, weight = floor((period - elapsed) * 65536 / period):
-- the arithmetic of src/store/weighted.rs, step for step. Every number stays an integer below 2^52
-- (limits are at most 2^35), so Lua's doubles compute it exactly and floor(a / b) is integer
-- division. A refused request writes nothing; an admitted one writes each counter and sets its
-- expiry to the end of the next window, when its count stops mattering. A sliding counter can't
-- reserve: a request that doesn't fit is refused whatever its max delay.
max_delay = -1
local ONE = 65536

local function weighted(previous, period, elapsed)
  return floor(previous * floor((period - elapsed) * ONE / period) / ONE)
end

-- The first elapsed time, at or after `elapsed` and within the window, at which the previous
-- window's weighted count is at most `target`; nil if only after the window ends.
local function first_at_most(previous, target, period, elapsed)
  if previous == 0 then
    return elapsed
  end
  local max_weight = floor(((target + 1) * ONE - 1) / previous)
  if max_weight >= ONE then
    return elapsed
  end
  local first = floor((ONE * period - (max_weight + 1) * period) / ONE) + 1
  if first < elapsed then
    first = elapsed
  end
  if first < period then
    return first
  end
  return nil
end

local function wait_until_fits(previous, current, limit, period, elapsed)
  local room = limit - cost
  if room < 0 then
    return period -- costs more than the limit: it never fits; say one period
  end
  if room >= current then
    local first = first_at_most(previous, room - current, period, elapsed)
    if first then
      return first - elapsed
    end
  end
  -- Not in this window: in the next one, this window's count is the previous one.
  return period - elapsed + (first_at_most(current, room, period, 0) or period)
end

local function wait_until_frees(previous, current, period, elapsed)
  local faded = weighted(previous, period, elapsed)
  if faded > 0 then
    local first = first_at_most(previous, faded - 1, period, elapsed)
    if first then
      return first - elapsed
    end
    return period - elapsed -- the previous count drops out when this window ends
  end
  if current == 0 then
    return 0
  end
  return period - elapsed + (first_at_most(current, current - 1, period, 0) or period)
end
-- (end of the helpers checked by tests/redis.rs)

local function inspect(i, limit, period)
  local key = KEYS[i]
  local window = now - now % period
  local stored = call('HMGET', key, 's', 'c', 'p')
  local start = tonumber(stored[1]) or window
  local current = tonumber(stored[2]) or 0
  local previous = tonumber(stored[3]) or 0
  if window > start then
    -- The window just ended becomes the previous one; older ones count for nothing.
    if window - start == period then
      previous = current
    else
      previous = 0
    end
    current = 0
    start = window
  end
  -- A clock that stepped back stays in the stored window.
  local elapsed = math.max(now - start, 0)
  return {key = key, limit = limit, period = period, start = start, previous = previous,
          current = current, elapsed = elapsed,
          fits = weighted(previous, period, elapsed) + current + cost <= limit}
end

local function wait(state)
  if cost > state.limit then
    return nil
  end
  return wait_until_fits(state.previous, state.current, state.limit, state.period, state.elapsed)
end

local function commit(state)
  state.current = state.current + cost
  call('HSET', state.key, 's', state.start, 'c', state.current, 'p', state.previous)
  call('PEXPIREAT', state.key, state.start + 2 * state.period)
end

local function give_back(i, _, period)
  local key = KEYS[i]
  local stored = call('HMGET', key, 's', 'c', 'p')
  local start = tonumber(stored[1])
  local field
  if not giving_back then
    if start == now - now % period then
      field = 'c'
    end
  else
    -- The charged window's count: the stored window's (current, or previous once time moved
    -- on), or the one before it, which still weighs in the estimate until the stored one ends.
    local charged = charged_at - charged_at % period
    if charged == start then
      field = 'c'
    elseif start and charged + period == start then
      field = 'p'
    end
  end
  if field then
    local count = tonumber(stored[field == 'c' and 2 or 3]) or 0
    if count > 0 then
      call('HSET', key, field, math.max(count - cost, 0))
    end
  end
end

local function undo()
end

local function report(state)
  local used = weighted(state.previous, state.period, state.elapsed) + state.current
  return math.max(state.limit - used, 0),
         wait_until_frees(state.previous, state.current, state.period, state.elapsed)
end
