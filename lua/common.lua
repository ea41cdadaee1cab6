-- The helpers every check shares (the start of the script; see lua/batch.lua): Redis calls and
-- integer arithmetic that don't depend on one request. Loaded as a Redis function library, this
-- part runs once, when the library loads, and may then touch no global: what it needs from
-- `redis` and `math` is set by lua/batch.lua at each call.
local call, floor

-- Caches of a function library live from one call to the next (a script's, for one call): they
-- save work that every call would repeat. Tables made per call cost Redis more than their use
-- (allocation and garbage collection), which is why these outlive the call.
--
-- `make`, remembered: a function of one key that calls `make(key)` only for a key it hasn't met,
-- and forgets everything past 1 000 keys, so it doesn't grow with what callers send.
local function remembered(make)
  local known, held = {}, 0
  return function(key)
    local value = known[key]
    if value == nil then
      value = make(key)
      if held == 1000 then
        known, held = {}, 0
      end
      known[key] = value
      held = held + 1
    end
    return value
  end
end

-- tonumber, remembered: the same limits, periods, costs and shape numbers come call after call,
-- and parsing a number costs Redis more than a table lookup.
-- (tonumber is looked up at each call: a library may touch no global while it loads.)
local number_of = remembered(function(text)
  return tonumber(text)
end)

-- The text of an integer, remembered: what redis.call is handed instead of a number, which Lua
-- would format anew each time with printf's "%.14g" (a measurable share of Redis's time per
-- check). The checks of a batch share its time, so a period's window start (a hash field), a
-- cost and a window's edge are the same for all. The same text Redis makes of the number
-- (integers below 2^53 print whole), so a counter reads alike whichever path wrote it.
local text_of = remembered(function(integer)
  return string.format('%d', integer)
end)

-- floor(a / b) for integers, exact even where the quotient of two doubles rounds up.
local function div(a, b)
  local q = floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

-- Whether this Redis takes PEXPIREAT's NX and GT options (7.0 on; 7.0 is also where scripts got
-- redis.REDIS_VERSION_NUM), and Redis's own time in ms, for Redis 6.2, which lacks them; both set
-- by lua/batch.lua at each call (the time only when the batch reads TIME: a batch at a fixed time
-- reads it here when it needs it).
local expire_options, clock

-- Redis's own time (ms), read once per batch.
local function clock_ms()
  if clock == nil then
    local time = call('TIME')
    clock = time[1] * 1000 + floor(time[2] / 1000)
  end
  return clock
end

-- Makes `key` live at least until `at` (ms), never shortening a later expiry: a clock that stepped
-- back, or a reservation ahead of `at`, must not cut a counter's life short. A key without an
-- expiry (one just created) gets one; GT alone would take its missing expiry for an infinite one.
-- `created`: whether the caller knows the key is new (true), knows it is not (false), or can't tell
-- (nil: try NX first, which only a new key takes). Returns whether the key had an expiry already
-- (it outlived an earlier call that set one).
local function expire_at_least(key, at, created)
  if created == true then
    call('PEXPIREAT', key, text_of(at))
    return false
  elseif expire_options then
    if created == false or call('PEXPIREAT', key, text_of(at), 'NX') == 0 then
      call('PEXPIREAT', key, text_of(at), 'GT')
      return true
    end
    return false
  else
    -- Redis 6.2: read the expiry (PTTL, relative to the time Redis reads when it runs it, which
    -- is at least the batch's clock) and extend it relatively. The key's expiry is at least
    -- clock + ttl, so one that reaches `at` by that is left alone. Otherwise PEXPIRE by
    -- max(ttl, at - clock) from Redis's time when it runs, no earlier than PTTL's or the clock:
    -- the expiry becomes at least the old one and at least `at`, later by at most the
    -- milliseconds the batch has run, never earlier.
    local ttl = call('PTTL', key)
    if ttl < 0 then
      call('PEXPIREAT', key, at)
      return false
    elseif clock_ms() + ttl < at then
      call('PEXPIRE', key, math.max(ttl, at - clock_ms()))
    end
    return true
  end
end

-- A fixed window's (lua/fixed_window.lua) counter charged for the first time in the window that
-- starts at `start`: makes it live to the window's end, and when it outlived an earlier window (a
-- key busy in every window) drops the count of the window before the last, so a busy counter
-- holds two windows' counts (the last one's kept for a clock that steps back into it) rather than
-- one per window it has lived through.
local function window_opened(key, start, period)
  if expire_at_least(key, start + period) then
    call('HDEL', key, text_of(start - 2 * period))
  end
end

-- The sliding log's (lua/sliding_log.lua) score of the n-th oldest admission (1-based), or nil.
local function nth_oldest(key, n)
  local found = call('ZRANGE', key, n - 1, n - 1, 'WITHSCORES')
  return tonumber(found[2])
end

-- ZADD takes members in batches, so a costly request never overflows Lua's stack with unpack.
local ZADD_BATCH = 1000

-- Adds `units` members scored `at` to a sliding log, named `at-<n>` for n from `first` on; returns
-- how many were new (a name already taken is not added again).
local function add_members(key, at, first, units)
  local added = 0
  local done = 0
  while done < units do
    local members = {}
    for _ = 1, math.min(ZADD_BATCH, units - done) do
      members[#members + 1] = text_of(at)
      members[#members + 1] = text_of(at) .. '-' .. text_of(first + done)
      done = done + 1
    end
    added = added + call('ZADD', key, unpack(members))
  end
  return added
end

-- Records `cost` admissions at `at` in the sliding log `key` that held `count` of them, and makes
-- it live until the newest leaves the window of `period`.
local function log_admit(key, at, count, cost, period)
  -- Members at one score need distinct names. Numbering them after the log's count works while
  -- time only moves forward, the common case; when names were taken (a clock that stepped back, a
  -- reservation made earlier for the same millisecond), the rest go after the highest number at
  -- that score.
  local added = add_members(key, at, count + 1, cost)
  if added < cost then
    local highest = 0
    for _, member in ipairs(call('ZRANGEBYSCORE', key, at, at)) do
      highest = math.max(highest, tonumber(string.match(member, '-(%d+)$')) or 0)
    end
    add_members(key, at, highest + 1, cost - added)
  end
  expire_at_least(key, at + period, count == 0)
end
