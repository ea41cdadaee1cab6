-- The common cases without the machinery (after lua/entry.lua, before lua/batch.lua): a check
-- (not a peek or a give-back) with no duplicate guard or concurrency limit. Each function decides
-- exactly what lua/entry.lua and the algorithm's part decide for such a check, but inline, without
-- the steps of options it lacks: the plainest policy, the most common, pays for nothing else, and
-- an option adds only its own commands. One that can't answer in a line (a refusal with an option
-- to apply, a reservation, an alert) leaves the check to lua/entry.lua.
--
-- fast.<code>(KEYS, key_at, shape, now, out, n): the check's keys are
-- KEYS[key_at + 1 .. key_at + shape.keys]; `shape` holds, per rule i, costs[i], limits[i] and
-- periods[i], and its options (see lua/batch.lua); `now` is the batch's time (ms). It writes the
-- check's entry into `out` after item n (see lua/batch.lua: an admission's short form, or the full
-- reply) and returns the index of its last item; or it returns nil having written nothing in
-- `out`, and lua/entry.lua decides the check: with nothing written in Redis either, but for what
-- it hands over (handed_count, handed_quota). It writes only after its last Redis command, so a
-- check that fails leaves `out` as it was.
local fast = {}

-- Whether charging `units` to a quota at `before` reaches one of its alerts' thresholds.
local function fires_alert(shape, before, units)
  for j = 1, shape.thresholds do
    local used = shape.useds[j]
    if before < used and before + units >= used then
      return true
    end
  end
  return false
end


-- The start of the quota's day at `now`, the batch's time: worked out once per shape and batch
-- (a hot identity's checks share both).
local function quota_today(shape, now)
  if shape.quota_now ~= now then
    shape.quota_now, shape.quota_start = now, quota_day_start(shape, now)
  end
  return shape.quota_start
end

-- quota_add, with the count of a day the batch has met charged in place.
local function quota_charge(shape, key, start, units)
  local days = quota_days[key]
  local known = days and days[start]
  if known == nil then
    return quota_add(shape, key, start, units)
  end
  local used = known[1] + units
  known[1] = used
  return used
end

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
-- charge back. One rule, the most common policy, takes a path without tables, and a daily quota,
-- a penalty block or a concurrency limit beside it (`shape.options`) adds only its own commands:
-- what doesn't admit the request at once (a block that holds, a rule, quota or concurrency limit
-- that refuses, an alert that fires) is left to lua/entry.lua, with the charges made
-- (handed_count, handed_quota). With more rules, options go to fast.admit.
fast.fw = function(KEYS, key_at, shape, now, out, n)
  local rules = shape.rules
  if rules == 1 then
    local key = KEYS[key_at + 1]
    if shape.block > 0 and block_end(KEYS[key_at + shape.block_at]) > now then
      return nil
    end
    local cost = shape.costs[1]
    local limit, period = shape.limits[1], shape.periods[1]
    local start = now - now % period
    local count = call('HINCRBY', key, text_of(start), text_of(cost))
    if count == cost then
      window_opened(key, start, period)
    end
    if count <= limit then
      local quota_limit, used, quota_start = shape.quota_limit, 0, 0
      if quota_limit > 0 then
        local quota_key, units = KEYS[key_at + shape.quota_at], shape.quota_cost
        quota_start = quota_today(shape, now)
        used = quota_charge(shape, quota_key, quota_start, units)
        if used > quota_limit or (shape.thresholds > 0 and fires_alert(shape, used - units, units))
        then
          handed_count, handed_quota = count, used
          return nil
        end
      end
      local max_in_flight, lease, held, earliest = shape.max_in_flight, 0, 0, nil
      if max_in_flight > 0 then
        local leases_key = KEYS[key_at + shape.in_flight_at]
        lease, held, earliest = lease_take_known(leases_key, max_in_flight, now + shape.lease)
        if lease == nil then
          held, earliest = leases_current(leases_key)
          if held >= max_in_flight then
            handed_count, handed_quota = count, quota_limit > 0 and used or nil
            return nil
          end
          lease, held, earliest = lease_take(leases_key, held, earliest, now + shape.lease)
        end
      end
      -- The admission's short form, written in place: this is the hottest line of the store.
      if count == 0 then
        out[n + 1] = limit
        out[n + 2] = 0
      else
        out[n + 1] = limit - count
        out[n + 2] = start + period - now
      end
      n = n + 2
      if quota_limit > 0 then
        out[n + 1] = quota_limit - used
        out[n + 2] = used > 0 and quota_start + shape.quota_day - now or 0
        n = n + 2
      end
      if max_in_flight > 0 then
        out[n + 1] = max_in_flight - held
        out[n + 2] = math.max(earliest - now, 0)
        out[n + 3] = lease
        n = n + 3
      end
      return n
    end
    if shape.options then
      handed_count = count
      return nil
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
  if shape.options then
    if shape.max_in_flight > 0 then
      return nil
    end
    return fast.admit(KEYS, key_at, shape, now, out, n)
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
  if rules == 1 then
    -- One rule admitting the request: its short form, without tables.
    local key, cost, limit, period = KEYS[key_at + 1], costs[1], shape.limits[1], shape.periods[1]
    local log = log_current(key, period)
    if log.count + cost <= limit then
      log_admit(key, now, log, cost, period)
      out[n + 1] = math.max(limit - log.count, 0)
      out[n + 2] = log.oldest and log.oldest + period - now or 0
      return n + 2
    end
  end
  local logs = {}
  local allowed = 1
  for i = 1, rules do
    local key = KEYS[key_at + i]
    local log = log_current(key, shape.periods[i])
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

-- Token bucket (lua/token_bucket.lua): a request that conforms to every bucket is charged in each
-- and answered in short; one that doesn't is left to lua/entry.lua (a bucket's inspect only
-- reads, and remembers what it read for the batch).
fast.tb = function(KEYS, key_at, shape, now, out, n)
  local rules, costs = shape.rules, shape.costs
  local inspect = token_bucket.inspect
  for i = 1, rules do
    if not inspect(shape, i, KEYS[key_at + i], costs[i]) then
      return nil
    end
  end
  local commit, report = token_bucket.commit, token_bucket.report
  for i = 1, rules do
    commit(shape, i, KEYS[key_at + i], costs[i], now, now_us)
  end
  for i = 1, rules do
    out[n + 1], out[n + 2] = report(shape, i)
    n = n + 2
  end
  for i = 1, rules do
    out[n + i] = token_bucket.mark(i)
  end
  return n + rules
end

-- Any algorithm, with a daily quota, a penalty block or a max delay (no duplicate guard, lease
-- or give-back): a request that every rule and the quota admit at once, while no block holds and
-- no alert fires, is charged and answered in short. Any other is left to lua/entry.lua: its
-- rules' speculative charges taken back first, its quota's handed over.
fast.admit = function(KEYS, base, shape, now, out, n)
  if shape.block > 0 and block_end(KEYS[base + shape.block_at]) > now then
    return nil
  end
  local algorithm, rules, costs = shape.algorithm, shape.rules, shape.costs
  for i = 1, rules do
    if not algorithm.inspect(shape, i, KEYS[base + i], costs[i], false) then
      for j = 1, i do
        algorithm.undo(shape, j, KEYS[base + j], costs[j], false)
      end
      return nil
    end
  end
  local quota_limit, quota_count, quota_start = shape.quota_limit, 0, 0
  if quota_limit > 0 then
    local key, units = KEYS[base + shape.quota_at], shape.quota_cost
    quota_start = quota_today(shape, now)
    quota_count = quota_charge(shape, key, quota_start, units)
    if quota_count > quota_limit or fires_alert(shape, quota_count - units, units) then
      for j = 1, rules do
        algorithm.undo(shape, j, KEYS[base + j], costs[j], false)
      end
      handed_quota = quota_count
      return nil
    end
  end
  for i = 1, rules do
    algorithm.commit(shape, i, KEYS[base + i], costs[i], now, now_us)
  end
  for i = 1, rules do
    out[n + 1], out[n + 2] = algorithm.report(shape, i)
    n = n + 2
  end
  if quota_limit > 0 then
    out[n + 1] = math.max(quota_limit - quota_count, 0)
    out[n + 2] = quota_count > 0 and quota_start + shape.quota_day - now or 0
    n = n + 2
  end
  if algorithm.marks then
    for i = 1, rules do
      out[n + i] = algorithm.mark(i)
    end
    n = n + rules
  end
  return n
end

-- Per rule of the give-back being run: its count after it.
local given_counts = {}

-- A fixed window's give-back (count_only, Admitted::refund, a settle below its estimate) with no
-- other option (no quota, guard, block or concurrency limit): each rule's units go back where the receipt says they were charged (lua/entry.lua), and
-- the entry answers as a peek of one unit, in short when every rule has room for it.
fast.fw_give_back = function(KEYS, key_at, shape, now, out, n, receipt)
  if receipt == nil then
    error('a give-back without its receipt')
  end
  local rules, costs, limits, periods = shape.rules, shape.costs, shape.limits, shape.periods
  local give = gives_back(KEYS[key_at + shape.marker_at], receipt)
  local checked = receipt[1]
  local room = true
  for i = 1, rules do
    local key, period = KEYS[key_at + i], periods[i]
    local start = now - now % period
    local count
    if give and checked - checked % period == start then
      count = take_back(key, text_of(start), costs[i])
    else
      count = tonumber(call('HGET', key, text_of(start))) or 0
    end
    given_counts[i] = count
    if count + 1 > limits[i] then
      room = false
    end
  end
  if room then
    for i = 1, rules do
      local period = periods[i]
      out[n + 1], out[n + 2] =
        fixed_window_state(limits[i], given_counts[i], now - now % period + period, now)
      n = n + 2
    end
    return n
  end
  n = reply_head(out, n, rules, 0)
  for i = 1, rules do
    local limit, period = limits[i], periods[i]
    local ends = now - now % period + period
    local count = given_counts[i]
    local retry = -1
    if count + 1 > limit then
      retry = limit < 1 and period or ends - now
    end
    out[n + 1], out[n + 2] = fixed_window_state(limit, count, ends, now)
    out[n + 3] = retry
    n = n + 3
  end
  return n
end
