-- Sliding-window counter, every rule of one request in one call: check all, then record in all or none.
--
-- KEYS[i]   the counter of rule i: a hash {s = start of the current window (ms), c = its count,
--           p = the previous window's count}. All keys of one identity share a hash tag, so the
--           script runs on Redis Cluster.
-- ARGV[1]   the request's cost (units)
-- ARGV[2i]  rule i's limit;  ARGV[2i+1]  rule i's period (ms)
--
-- Reply: {allowed (1|0), now (ms, Redis TIME), then per rule: remaining, reset (ms), retry (ms, -1 if
-- this rule admits the request)}. Windows are aligned to the epoch, as in the in-memory store.
--
-- used = floor(previous * weight / 65536) + current, weight = floor((period - elapsed) * 65536 / period):
-- the arithmetic of src/store/weighted.rs, step for step. Every number stays an integer below 2^52
-- (limits are at most 2^35), so Lua's doubles compute it exactly and floor(a / b) is integer
-- division. A refused request writes nothing; an admitted one writes each counter and sets its
-- expiry to the end of the next window, when its count stops mattering.
local call = redis.call
local floor = math.floor
local ONE = 65536

local time = call('TIME')
local now = time[1] * 1000 + floor(time[2] / 1000)
local cost = tonumber(ARGV[1])
local rules = #KEYS

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

local counters = {}
local allowed = 1
for i = 1, rules do
  local limit = tonumber(ARGV[2 * i])
  local period = tonumber(ARGV[2 * i + 1])
  local window = now - now % period
  local stored = call('HMGET', KEYS[i], 's', 'c', 'p')
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
  if weighted(previous, period, elapsed) + current + cost > limit then
    allowed = 0
  end
  counters[i] = {limit, period, start, previous, current, elapsed}
end

local reply = {allowed, now}
for i = 1, rules do
  local limit, period, start, previous, current, elapsed = unpack(counters[i])
  local retry = -1
  if allowed == 1 then
    current = current + cost
    call('HSET', KEYS[i], 's', start, 'c', current, 'p', previous)
    call('PEXPIREAT', KEYS[i], start + 2 * period)
  elseif weighted(previous, period, elapsed) + current + cost > limit then
    retry = wait_until_fits(previous, current, limit, period, elapsed)
  end
  reply[#reply + 1] = math.max(limit - weighted(previous, period, elapsed) - current, 0)
  reply[#reply + 1] = wait_until_frees(previous, current, period, elapsed)
  reply[#reply + 1] = retry
end
return reply
