-- The common case without the machinery (after lua/common.lua, before lua/batch.lua): a check
-- whose options are empty (no delay, duplicate guard, penalty block or quota) of a fixed window or
-- a sliding log. Each function decides exactly what the algorithm's check function (lua/head.lua,
-- the algorithm's part, lua/tail.lua) decides for such a check, reply included, but reads its keys
-- and arguments in place and defines nothing per check: the generic function creates a dozen
-- closures and tables per check, which cost Redis about as much as the check's own commands.
--
-- fast.<code>(KEYS, ARGV, key_at, rules, arg_at, now, out, n): the check's keys are
-- KEYS[key_at + 1 .. key_at + rules], its cost ARGV[arg_at], its limit and period of rule i
-- ARGV[arg_at + 2i] and ARGV[arg_at + 2i + 1]; `now` is the batch's time (ms). It writes the
-- check's reply into `out` after item n, as lua/batch.lua replies (its length, then its items),
-- and returns the index of its last item. It writes only after its last Redis command, so a check
-- that fails leaves `out` as it was.
local fast = {}

-- The limit and period of the check's rule i.
local function rule_of(ARGV, arg_at, i)
  return number_of(ARGV[arg_at + 2 * i]), number_of(ARGV[arg_at + 2 * i + 1])
end

-- Writes a reply's head (length, allowed, now, no delay) after item n; returns the index of its
-- last item.
local function reply_head(out, n, rules, allowed, now)
  out[n + 1] = 3 + 3 * rules
  out[n + 2] = allowed
  out[n + 3] = now
  out[n + 4] = 0
  return n + 4
end

-- Writes one rule's item (remaining, reset, retry) after item n; returns the index of its last.
local function rule_item(out, n, remaining, reset, retry)
  out[n + 1] = remaining
  out[n + 2] = reset
  out[n + 3] = retry
  return n + 3
end

-- The fixed window's item of a rule that holds `count` of `limit` in the window ending at `ends`.
local function fixed_window_item(out, n, limit, count, ends, now, retry)
  if count == 0 then
    return rule_item(out, n, limit, 0, retry)
  end
  return rule_item(out, n, math.max(limit - count, 0), ends - now, retry)
end

-- Fixed window (lua/fixed_window.lua): charge every rule with HINCRBY; if one refuses, take every
-- charge back. One rule, the most common policy, takes a path without tables.
fast.fw = function(KEYS, ARGV, key_at, rules, arg_at, now, out, n)
  local cost = number_of(ARGV[arg_at])
  if rules == 1 then
    local key = KEYS[key_at + 1]
    -- rule_of(ARGV, arg_at, 1), inlined: this path runs once per admitted request.
    local limit, period = number_of(ARGV[arg_at + 2]), number_of(ARGV[arg_at + 3])
    local start = now - now % period
    local count = call('HINCRBY', key, field_of(start), cost)
    if count == cost then
      expire_at_least(key, start + period)
    end
    if count <= limit then
      -- The admitted request's reply, written in place: this is the hottest line of the store.
      out[n + 1] = 6
      out[n + 2] = 1
      out[n + 3] = now
      out[n + 4] = 0
      if count == 0 then
        out[n + 5] = limit
        out[n + 6] = 0
      else
        out[n + 5] = limit - count
        out[n + 6] = start + period - now
      end
      out[n + 7] = -1
      return n + 7
    end
    call('HINCRBY', key, field_of(start), 0 - cost)
    local retry = start + period - now
    if cost > limit then
      retry = period
    end
    n = reply_head(out, n, 1, 0, now)
    return fixed_window_item(out, n, limit, count - cost, start + period, now, retry)
  end
  local counts = {}
  local allowed = 1
  for i = 1, rules do
    local key = KEYS[key_at + i]
    local limit, period = rule_of(ARGV, arg_at, i)
    local start = now - now % period
    local count = call('HINCRBY', key, field_of(start), cost)
    if count == cost then
      expire_at_least(key, start + period)
    end
    counts[i] = count
    if count > limit then
      allowed = 0
    end
  end
  if allowed == 0 then
    for i = 1, rules do
      local _, period = rule_of(ARGV, arg_at, i)
      call('HINCRBY', KEYS[key_at + i], field_of(now - now % period), 0 - cost)
    end
  end
  n = reply_head(out, n, rules, allowed, now)
  for i = 1, rules do
    local limit, period = rule_of(ARGV, arg_at, i)
    local ends = now - now % period + period
    local count = counts[i]
    local retry = -1
    if allowed == 0 then
      if count > limit then
        retry = ends - now
        if cost > limit then
          retry = period
        end
      end
      count = count - cost
    end
    n = fixed_window_item(out, n, limit, count, ends, now, retry)
  end
  return n
end

-- Sliding log (lua/sliding_log.lua): count every rule's window; record in all if all admit.
fast.sl = function(KEYS, ARGV, key_at, rules, arg_at, now, out, n)
  local cost = number_of(ARGV[arg_at])
  local counts = {}
  local allowed = 1
  for i = 1, rules do
    local key = KEYS[key_at + i]
    local limit, period = rule_of(ARGV, arg_at, i)
    call('ZREMRANGEBYSCORE', key, '-inf', now - period)
    local count = call('ZCARD', key)
    counts[i] = count
    if count + cost > limit then
      allowed = 0
    end
  end
  -- Every Redis command comes before the reply is written (see above).
  local items = {}
  for i = 1, rules do
    local key = KEYS[key_at + i]
    local limit, period = rule_of(ARGV, arg_at, i)
    local count = counts[i]
    local retry = -1
    if allowed == 1 then
      log_admit(key, now, count, cost, period)
      count = count + cost
    elseif count + cost > limit then
      if cost > limit then
        retry = period
      else
        -- It fits once `count + cost - limit` of the oldest admissions leave the window.
        retry = nth_oldest(key, count + cost - limit) + period - now
      end
    end
    local oldest = nth_oldest(key, 1)
    items[3 * i - 2] = math.max(limit - count, 0)
    items[3 * i - 1] = oldest and oldest + period - now or 0
    items[3 * i] = retry
  end
  n = reply_head(out, n, rules, allowed, now)
  for i = 1, 3 * rules do
    out[n + i] = items[i]
  end
  return n + 3 * rules
end
