-- The common case without the machinery (after lua/common.lua, before lua/batch.lua): a check
-- whose options are empty (no delay, duplicate guard, penalty block or quota) of a fixed window or
-- a sliding log. Each function decides exactly what the algorithm's check function (lua/head.lua,
-- the algorithm's part, lua/tail.lua) decides for such a check, reply included, but reads its keys
-- and arguments in place and defines nothing per check: the generic function creates a dozen
-- closures and tables per check, which cost Redis about as much as the check's own commands.
--
-- fast.<code>(key_at, rules, arg_at, now_us): the check's keys are KEYS[key_at + 1 ..
-- key_at + rules], its cost ARGV[arg_at], its limit and period of rule i ARGV[arg_at + 2i] and
-- ARGV[arg_at + 2i + 1].
local fast = {}

-- The limit and period of the check's rule i.
local function rule_of(arg_at, i)
  return tonumber(ARGV[arg_at + 2 * i]), tonumber(ARGV[arg_at + 2 * i + 1])
end

-- Fixed window (lua/fixed_window.lua): charge every rule with HINCRBY; if one refuses, take every
-- charge back.
fast.fw = function(key_at, rules, arg_at, now_us)
  local now = floor(now_us / 1000)
  local cost = tonumber(ARGV[arg_at])
  local counts = {}
  local allowed = 1
  for i = 1, rules do
    local key = KEYS[key_at + i]
    local limit, period = rule_of(arg_at, i)
    local start = now - now % period
    local count = call('HINCRBY', key, start, cost)
    if count == cost then
      expire_at_least(key, start + period)
    end
    counts[i] = count
    if count > limit then
      allowed = 0
    end
  end
  local reply = {allowed, now, 0}
  for i = 1, rules do
    local limit, period = rule_of(arg_at, i)
    local start = now - now % period
    local count = counts[i]
    local retry = -1
    if allowed == 0 then
      call('HINCRBY', KEYS[key_at + i], start, 0 - cost)
      if count > limit then
        if cost > limit then
          retry = period
        else
          retry = start + period - now
        end
      end
      count = count - cost
    end
    local at = 3 * i + 1
    if count == 0 then
      reply[at] = limit
      reply[at + 1] = 0
    else
      reply[at] = math.max(limit - count, 0)
      reply[at + 1] = start + period - now
    end
    reply[at + 2] = retry
  end
  return reply
end

-- Sliding log (lua/sliding_log.lua): count every rule's window; record in all if all admit.
fast.sl = function(key_at, rules, arg_at, now_us)
  local now = floor(now_us / 1000)
  local cost = tonumber(ARGV[arg_at])
  local counts = {}
  local allowed = 1
  for i = 1, rules do
    local key = KEYS[key_at + i]
    local limit, period = rule_of(arg_at, i)
    call('ZREMRANGEBYSCORE', key, '-inf', now - period)
    local count = call('ZCARD', key)
    counts[i] = count
    if count + cost > limit then
      allowed = 0
    end
  end
  local reply = {allowed, now, 0}
  for i = 1, rules do
    local key = KEYS[key_at + i]
    local limit, period = rule_of(arg_at, i)
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
    local at = 3 * i + 1
    local oldest = nth_oldest(key, 1)
    reply[at] = math.max(limit - count, 0)
    reply[at + 1] = oldest and oldest + period - now or 0
    reply[at + 2] = retry
  end
  return reply
end
