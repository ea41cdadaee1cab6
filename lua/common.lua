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
      -- (nil is not remembered: a key that makes nothing is read anew, and fills nothing.)
      if value ~= nil then
        if held == 1000 then
          known, held = {}, 0
        end
        known[key] = value
        held = held + 1
      end
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

-- The error a write that moves a stored count by a difference (INCRBY, HINCRBY) meets on a value
-- that is not an integer (a key written by hand, or by something else): raised by the check that
-- would write it, as the command would have, so the batch's writes left for its end (which run
-- outside any check, lua/batch.lua) never meet it.
local NOT_AN_INTEGER = {err = 'ERR value is not an integer or out of range'}

-- Whether a stored count's text is an integer Redis can move by a difference (nil: no value):
-- digits, at most 16 of them (what the crate writes stays below 2^53, so a charge never takes it
-- past a 64-bit integer).
local function integer_text(text)
  return text == nil or text == false or (#text <= 17 and string.find(text, '^%-?%d+$') ~= nil)
end

-- A request's costs, from its text (the cost piece of a shape, lua/batch.lua): `<cost>`, or, when a rule or the
-- quota counts metered units, `<cost>:<units>:<flags>`, with one flag per counted rule and then
-- one for the quota: `m` (it counts the units) or `r` (it counts the cost). Returns a table of
-- each counted rule's cost, the quota's last (at rules + 1), remembered.
local costs_of = remembered(function(text)
  local cost = tonumber(text)
  local costs = {}
  if cost then
    -- (Indexes past the rules' read the cost too.)
    return setmetatable(costs, {__index = function() return cost end})
  end
  local request, units, flags = string.match(text, '^(%d+):(%d+):([mr]+)$')
  if request == nil then
    error('malformed cost ' .. text)
  end
  request, units = tonumber(request), tonumber(units)
  for i = 1, #flags do
    costs[i] = string.byte(flags, i) == 109 and units or request
  end
  -- (Kept whole too, for the same costs with more units: lua/claims.lua.)
  costs.request, costs.units, costs.flags = request, units, flags
  return setmetatable(costs, {__index = function() return request end})
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

-- The batch's time, in ms and µs (Redis TIME, or a time tests fix), set by lua/batch.lua at each
-- call: every check of a batch is checked at it.
local now, now_us

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

-- Takes up to `units` back from the count in `field` of the hash `key`, never below zero, in one
-- command when it held them (a give-back's common case); returns the count left. A field that
-- held nothing is removed rather than written (the key may be gone: a field written anew would
-- make it a key without an expiry).
local function take_back(key, field, units)
  if units == 0 then
    return tonumber(call('HGET', key, field)) or 0
  end
  local left = call('HINCRBY', key, field, text_of(0 - units))
  if left >= 0 then
    return left
  end
  if left == 0 - units then
    call('HDEL', key, field)
  else
    call('HINCRBY', key, field, text_of(0 - left))
  end
  return 0
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

-- ZADD takes members in batches, so a long log never overflows Lua's stack with unpack.
local ZADD_BATCH = 1000

-- A sliding log (lua/sliding_log.lua) holds one member per admitted request, however much it
-- costs (or per batch's admissions at one time: see log_flush): no request costs Redis work or
-- memory in proportion to its cost. A member's score is
-- its admission's time (ms); its name, `<first>:<units>`, numbers the request's units among all
-- the log has held since it was last empty: `first`, the number of its first unit, is written
-- after a letter that gives its digit count (a for 1 digit, b for 2, ...), so that the names of
-- one score sort in admission order as the scores do. The log holds the newest member's
-- first + units less the oldest one's first; the n-th oldest unit is in the member whose units
-- span it, found by a binary search over ranks. Members go in time order: one admitted before
-- the newest (a clock that stepped back, a reservation ahead) is scored as the newest, which
-- only counts it longer.
local function log_name(first, units)
  local digits = string.format('%d', first)
  return string.char(96 + #digits) .. digits .. ':' .. text_of(units)
end

-- The logs the batch has trimmed and read (then admitted into), by key: a hot log's checks of one
-- batch trim and read it once. (Every check of a batch is checked at its time; nothing else writes
-- a key while the batch runs, a script being atomic; and no key expires meanwhile, Redis holding a
-- script's time still. So what a batch has read or written of a key is what the key holds until
-- the batch ends. The token bucket, the sliding counter and the penalty block keep theirs too.)
-- Forgotten at each batch.
local logs_known = {}

local function forget_logs()
  if next(logs_known) ~= nil then
    logs_known = {}
  end
end

-- A batch's admissions into a log wait in it (`log.pending`: the units, the first's number, their
-- time) and go to Redis as one member when the batch ends or something reads the log's members:
-- a hot log's checks of one batch, all at the batch's time, add one member rather than one each
-- (a member of k units at t counts, expires and gives back as k members at t would). The key's
-- expiry waits with them (the key may not exist before). Writes what waits of log `key`.
local function log_flush(key)
  local log = logs_known[key]
  if log == nil then
    return
  end
  local pending = log.pending
  if pending ~= nil then
    log.pending = nil
    call('ZADD', key, text_of(pending.at), log_name(pending.first, pending.units))
  end
  if log.expire_due then
    log.expire_due = false
    expire_at_least(key, log.expires, log.expire_created)
    log.expire_created = false
  end
end

-- Writes what waits of every log the batch holds (see log_flush): at its end.
local function flush_logs()
  for key in pairs(logs_known) do
    log_flush(key)
  end
end


-- The member at `rank` of a log (0: the oldest, -1: the newest): its score, first unit and
-- units; nil when there is none.
local function log_member(key, rank)
  log_flush(key)
  local found = call('ZRANGE', key, rank, rank, 'WITHSCORES')
  if found[1] == nil then
    return nil
  end
  local first, units = string.match(found[1], '^%a(%d+):(%d+)$')
  return tonumber(found[2]), tonumber(first), tonumber(units)
end

-- Lua's doubles count exactly below 2^53: a log never empty for so long that its numbers reach
-- this (2^50 units, years at millions of units a second) is numbered again from 0.
local LOG_RENUMBER_AT = 2 ^ 50

-- The log, after its expired members left: {oldest (ms), base (the oldest's first unit),
-- newest (ms), next (the number of the next unit), count (units held), skip (the expired members
-- before the oldest: 0)}; nil times and zeros when it is empty.
local function log_read(key)
  local oldest, base = log_member(key, 0)
  if oldest == nil then
    return {base = 0, next = 0, count = 0, skip = 0}
  end
  local newest, first, units = log_member(key, -1)
  return {oldest = oldest, base = base, newest = newest, next = first + units,
          count = first + units - base, skip = 0}
end

-- The log `key` after its members older than `period` left (see log_read), trimmed and read once
-- per batch.
local function log_current(key, period)
  local log = logs_known[key]
  if log == nil then
    call('ZREMRANGEBYSCORE', key, '-inf', text_of(now - period))
    log = log_read(key)
    logs_known[key] = log
  end
  return log
end

-- log_read for a peek, which removes nothing: the members scored after `after` count, and `skip`
-- says how many expired ones come before them.
local function log_read_after(key, after)
  log_flush(key)
  local found = call('ZRANGEBYSCORE', key, '(' .. text_of(after), '+inf', 'WITHSCORES', 'LIMIT',
                     0, 1)
  if found[1] == nil then
    return {base = 0, next = 0, count = 0, skip = 0}
  end
  local base = tonumber(string.match(found[1], '^%a(%d+):'))
  local newest, first, units = log_member(key, -1)
  return {oldest = tonumber(found[2]), base = base, newest = newest, next = first + units,
          count = first + units - base, skip = call('ZCOUNT', key, '-inf', text_of(after))}
end

-- The time (ms) of the admission holding unit `n` (1-based) of `log`, counted from its oldest.
local function log_unit_at(key, log, n)
  log_flush(key)
  local target = log.base + n - 1
  -- The last member whose first unit is at most the target: every member holds a unit at least,
  -- so its rank is at most n - 1 past the expired ones.
  local low = log.skip
  local high = math.min(call('ZCARD', key), low + n) - 1
  while low < high do
    local middle = floor((low + high + 1) / 2)
    local _, first = log_member(key, middle)
    if first <= target then
      low = middle
    else
      high = middle - 1
    end
  end
  return (log_member(key, low))
end

-- Numbers the log's units from 0 again (see LOG_RENUMBER_AT): the same members, times and order,
-- under new names. The key loses its expiry; the caller sets it. Returns the next number.
local function log_renumber(key, log)
  log_flush(key)
  local members = call('ZRANGE', key, 0, -1, 'WITHSCORES')
  call('DEL', key)
  local renamed = {}
  for i = 1, #members, 2 do
    local first, units = string.match(members[i], '^%a(%d+):(%d+)$')
    renamed[#renamed + 1] = members[i + 1]
    renamed[#renamed + 1] = log_name(tonumber(first) - log.base, tonumber(units))
    if #renamed == 2 * ZADD_BATCH or i + 1 == #members then
      call('ZADD', key, unpack(renamed))
      renamed = {}
    end
  end
  log.base = 0
  return log.count
end

-- Renames the member `name` (scored `score`, holding `units` from `first`) to start at `to`:
-- the new name is added before the old one goes, so the key (and its expiry) never lapses.
local function log_move(key, score, name, to, units)
  call('ZADD', key, score, log_name(to, units))
  call('ZREM', key, name)
end

-- Gives back up to `units` of the sliding log `key` from its members admitted at or before `at`
-- (ms), newest first (a give-back's: its own member is the newest of them, unless it was
-- scored later, at a newer member's time; older ones then give back, which leave no later).
-- The log stays numbered without a gap (it holds the newest's first + units less the oldest's
-- first): the members on the shorter side of a shrunk one move by what it gave back, those
-- before it up, or those after it down.
local function log_give_back(key, units, at)
  log_flush(key)
  local left = units
  while left > 0 do
    local found = call('ZREVRANGEBYSCORE', key, text_of(at), '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if found[1] == nil then
      return
    end
    local name, score = found[1], found[2]
    local first, held = string.match(name, '^%a(%d+):(%d+)$')
    first, held = tonumber(first), tonumber(held)
    local back = math.min(left, held)
    left = left - back
    local rank = call('ZRANK', key, name)
    local after = call('ZCARD', key) - 1 - rank
    if rank < after then
      -- Fewer before it: it keeps its last units, and those before it move up, newest first
      -- (so that no new name is one still held).
      if held > back then
        log_move(key, score, name, first + back, held - back)
      else
        call('ZREM', key, name)
      end
      -- (None when it is the oldest: ZRANGE 0 -1 would be the whole log.)
      if rank > 0 then
        local before = call('ZRANGE', key, 0, rank - 1, 'WITHSCORES')
        for j = #before - 1, 1, -2 do
          local from, own = string.match(before[j], '^%a(%d+):(%d+)$')
          log_move(key, before[j + 1], before[j], tonumber(from) + back, tonumber(own))
        end
      end
    else
      -- Fewer after it (or as many): it keeps its first units, and those after it move down,
      -- oldest first.
      local later = call('ZRANGE', key, rank + 1, -1, 'WITHSCORES')
      if held > back then
        log_move(key, score, name, first, held - back)
      else
        call('ZREM', key, name)
      end
      for j = 1, #later, 2 do
        local from, own = string.match(later[j], '^%a(%d+):(%d+)$')
        log_move(key, later[j + 1], later[j], tonumber(from) - back, tonumber(own))
      end
    end
  end
end

-- Records a request of `cost` admitted at `at` in the sliding log `key`, read as `log` (see
-- log_read), and makes it live until its newest member leaves the window of `period`. A request
-- of cost 0 adds nothing, but still gets the key's expiry.
local function log_admit(key, at, log, cost, period)
  at = math.max(at, log.newest or at)
  local created = log.count == 0
  if cost > 0 then
    if log.next + cost >= LOG_RENUMBER_AT then
      log.next = log_renumber(key, log)
      created = true
    end
    -- Joins the admissions waiting at the same time, else goes after them (see log_flush).
    local pending = log.pending
    if pending ~= nil and pending.at == at and pending.first + pending.units == log.next then
      pending.units = pending.units + cost
    else
      log_flush(key)
      log.pending = {at = at, first = log.next, units = cost}
    end
    log.oldest = log.oldest or at
    log.newest = at
    log.next = log.next + cost
    log.count = log.count + cost
  end
  -- An empty log is no key: nothing to expire, nor to note. A key made now (its first member,
  -- or numbered anew) takes its expiry; one that holds members keeps an expiry this batch set
  -- already, as late. (Set with the waiting admissions: see log_flush.)
  if log.count == 0 then
    return
  end
  local expires = at + period
  if created or not log.expires or expires > log.expires then
    log.expires = expires
    log.expire_due = true
    log.expire_created = log.expire_created or created
  end
end
