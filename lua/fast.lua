-- The common case without the machinery (after lua/common.lua, before lua/batch.lua): a check
-- whose options are empty (no delay, duplicate guard, penalty block or quota) of a fixed window or
-- a sliding log. Each function decides exactly what a check of lua/entry.lua and the algorithm's
-- part decides for such a check, but inline, without the steps of options and the calls into the
-- algorithm's part: the plainest policy, the most common, pays for nothing else.
--
-- fast.<code>(KEYS, key_at, shape, now, out, n): the check's keys are
-- KEYS[key_at + 1 .. key_at + shape.rules]; `shape` holds, per rule i, costs[i], limits[i] and
-- periods[i] (see lua/batch.lua); `now` is the batch's time (ms). It writes the check's entry into
-- `out` after item n (see lua/batch.lua: an admission's short form, or the full reply) and returns
-- the index of its last item. It writes only after its last Redis command, so a check that fails
-- leaves `out` as it was.
local fast = {}

-- Writes the full reply's head (its length, negated: see lua/batch.lua; allowed; no delay) of a
-- check of `rules` rules after item n; returns the index of its last item.
local function reply_head(out, n, rules, allowed)
  out[n + 1] = -(2 + 3 * rules)
  out[n + 2] = allowed
  out[n + 3] = 0
  return n + 3
end

-- The fixed window's remaining and reset of a rule that holds `count` of `limit` in the window
-- ending at `ends`.
local function fixed_window_state(limit, count, ends, now)
  if count == 0 then
    return limit, 0
  end
  return math.max(limit - count, 0), ends - now
end

-- Fixed window (lua/fixed_window.lua): charge every rule with HINCRBY; if one refuses, take every
-- charge back. One rule, the most common policy, takes a path without tables.
fast.fw = function(KEYS, key_at, shape, now, out, n)
  local rules = shape.rules
  if rules == 1 then
    local cost = shape.costs[1]
    local key = KEYS[key_at + 1]
    local limit, period = shape.limits[1], shape.periods[1]
    local start = now - now % period
    local count = call('HINCRBY', key, text_of(start), text_of(cost))
    if count == cost then
      window_opened(key, start, period)
    end
    if count <= limit then
      -- The admission's short form, written in place: this is the hottest line of the store.
      if count == 0 then
        out[n + 1] = limit
        out[n + 2] = 0
      else
        out[n + 1] = limit - count
        out[n + 2] = start + period - now
      end
      return n + 2
    end
    call('HINCRBY', key, text_of(start), text_of(0 - cost))
    local retry = start + period - now
    if cost > limit then
      retry = period
    end
    n = reply_head(out, n, 1, 0)
    out[n + 1], out[n + 2] = fixed_window_state(limit, count - cost, start + period, now)
    out[n + 3] = retry
    return n + 3
  end
  local counts = {}
  local allowed = 1
  for i = 1, rules do
    local key = KEYS[key_at + i]
    local period = shape.periods[i]
    local start = now - now % period
    local cost = shape.costs[i]
    local count = call('HINCRBY', key, text_of(start), text_of(cost))
    if count == cost then
      window_opened(key, start, period)
    end
    counts[i] = count
    if count > shape.limits[i] then
      allowed = 0
    end
  end
  if allowed == 1 then
    for i = 1, rules do
      local period = shape.periods[i]
      out[n + 2 * i - 1], out[n + 2 * i] =
        fixed_window_state(shape.limits[i], counts[i], now - now % period + period, now)
    end
    return n + 2 * rules
  end
  for i = 1, rules do
    local period = shape.periods[i]
    call('HINCRBY', KEYS[key_at + i], text_of(now - now % period), text_of(0 - shape.costs[i]))
  end
  n = reply_head(out, n, rules, 0)
  for i = 1, rules do
    local limit, period = shape.limits[i], shape.periods[i]
    local ends = now - now % period + period
    local count, cost = counts[i], shape.costs[i]
    local retry = -1
    if count > limit then
      retry = ends - now
      if cost > limit then
        retry = period
      end
    end
    out[n + 1], out[n + 2] = fixed_window_state(limit, count - cost, ends, now)
    out[n + 3] = retry
    n = n + 3
  end
  return n
end

-- Sliding log (lua/sliding_log.lua): count every rule's window; record in all if all admit.
fast.sl = function(KEYS, key_at, shape, now, out, n)
  local costs, rules = shape.costs, shape.rules
  local logs = {}
  local allowed = 1
  for i = 1, rules do
    local key = KEYS[key_at + i]
    call('ZREMRANGEBYSCORE', key, '-inf', text_of(now - shape.periods[i]))
    local log = log_read(key)
    logs[i] = log
    if log.count + costs[i] > shape.limits[i] then
      allowed = 0
    end
  end
  -- Every Redis command comes before the entry is written (see above).
  local items = {}
  for i = 1, rules do
    local key = KEYS[key_at + i]
    local limit, period = shape.limits[i], shape.periods[i]
    local log, cost = logs[i], costs[i]
    local retry = -1
    if allowed == 1 then
      log_admit(key, now, log, cost, period)
    elseif log.count + cost > limit then
      if cost > limit then
        retry = period
      else
        -- It fits once `count + cost - limit` of the oldest units leave the window.
        retry = log_unit_at(key, log, log.count + cost - limit) + period - now
      end
    end
    items[3 * i - 2] = math.max(limit - log.count, 0)
    items[3 * i - 1] = log.oldest and log.oldest + period - now or 0
    items[3 * i] = retry
  end
  if allowed == 1 then
    for i = 1, rules do
      out[n + 2 * i - 1] = items[3 * i - 2]
      out[n + 2 * i] = items[3 * i - 1]
    end
    return n + 2 * rules
  end
  n = reply_head(out, n, rules, 0)
  for i = 1, 3 * rules do
    out[n + i] = items[i]
  end
  return n + 3 * rules
end
