-- The end of every rate-limit script (see lua/head.lua): check every rule, then record in all or none.

-- A refund gives back its units in every counted rule and the day's quota, then answers as a peek
-- of one unit.
if refunding then
  if rules_give_back then
    for i = 1, rules do
      cost_for(i)
      give_back(i, rule_args(i))
    end
  end
  -- The quota's units go back to the day that was charged, while it lasts.
  if quota_key and (not giving_back or quota_day_start(charged_at) == quota_day_start()) then
    local start = quota_day_start()
    local count = tonumber(call('HGET', quota_key, start)) or 0
    if count > 0 then
      call('HINCRBY', quota_key, start, text_of(0 - math.min(cost_for(rules + 1), count)))
    end
  end
  costs = costs_of('1')
end
-- The quota's alerts an admission (or an overdraw) fired.
local fired = {}
-- Adds `units` to the day's quota count; fires the alerts whose threshold it reached first.
local function quota_charge(quota, units)
  local before = quota.count
  quota.count = call('HINCRBY', quota_key, quota.start, units)
  expire_at_least(quota_key, quota.start + quota_day)
  -- An alert fires when this request reaches its threshold first, once per key, threshold and
  -- day: the flag holds the day it fired for and lives 30 hours (SET NX semantics, kept per day).
  for j = 1, thresholds do
    local percent, used = threshold(j)
    local flag_key = KEYS[flags_from + j - 1]
    if before < used and quota.count >= used
        and tonumber(call('GET', flag_key)) ~= quota.start then
      call('SET', flag_key, quota.start, 'PX', 30 * 3600 * 1000)
      fired[#fired + 1] = percent
    end
  end
end
-- An overdraw charges every counted rule and the quota in their current windows without a
-- check, each by at most its limit (a token bucket's burst), then answers as a peek.
if overdrawing then
  peek = false
  for i = 1, rules do
    local limit, period, burst = rule_args(i)
    cost = math.min(cost_for(i), burst)
    if cost > 0 then
      commit(inspect(i, limit, period, burst), now, now_us)
    end
  end
  if quota_key then
    local start = quota_day_start()
    local units = math.min(cost_for(rules + 1), quota_limit)
    if units > 0 then
      quota_charge({start = start, count = tonumber(call('HGET', quota_key, start)) or 0}, units)
    end
  end
  peek = true
  costs = costs_of('1')
end
local states = {}
local allowed = 1
if guard_stamp then
  allowed = 0
end
local refused_by_rules = false
-- The wait until every refusing rule admits the request; nil when one never will.
local longest_wait = 0
for i = 1, rules do
  cost_for(i)
  local state = inspect(i, rule_args(i))
  states[i] = state
  if not state.fits then
    allowed = 0
    refused_by_rules = true
    local rule_wait = wait(state)
    if rule_wait == nil or longest_wait == nil then
      longest_wait = nil
    elseif rule_wait > longest_wait then
      longest_wait = rule_wait
    end
  end
end

-- The daily quota: a fixed window of one day, starting at the quota's midnight.
local quota = nil
if quota_key then
  local start = quota_day_start()
  local count = tonumber(call('HGET', quota_key, start)) or 0
  quota = {start = start, count = count, fits = count + cost_for(rules + 1) <= quota_limit}
  if not quota.fits then
    allowed = 0
  end
end

-- The concurrency limit: leases past their expiry are gone (their requests ended without a word,
-- their instance died), the others each hold a slot.
local in_flight = nil
if in_flight_key then
  local held
  if peek then
    held = call('ZCOUNT', in_flight_key, '(' .. text_of(now), '+inf')
  else
    call('ZREMRANGEBYSCORE', in_flight_key, '-inf', now)
    held = call('ZCARD', in_flight_key)
  end
  in_flight = {held = held, fits = held < max_in_flight}
  if not in_flight.fits then
    allowed = 0
  end
end

-- When a refused quota admits the request: at the end of its day, or (a cost above its limit,
-- which no day admits) a day from now.
local function quota_wait()
  if cost_for(rules + 1) > quota_limit then
    return quota_day
  end
  return quota.start + quota_day - now
end

-- When the earliest lease expires (0: none is held).
local function slot_frees()
  local earliest
  if peek then
    -- (Expired leases are still there: a peek removes nothing.)
    earliest = call('ZRANGEBYSCORE', in_flight_key, '(' .. text_of(now), '+inf', 'WITHSCORES',
                    'LIMIT', 0, 1)[2]
  else
    earliest = call('ZRANGE', in_flight_key, 0, 0, 'WITHSCORES')[2]
  end
  if earliest then
    return math.max(tonumber(earliest) - now, 0)
  end
  return 0
end

-- During a penalty block nothing is admitted or counted. Every item is refused until the later of
-- the block's end and the time it would admit the request itself: a client that waits as long as
-- Retry-After says must not find a rule still full, and be refused and blocked anew.
if blocked_for > 0 then
  local reply = {0, 0}
  local function refused_for(own_wait)
    local until_free = math.max(blocked_for, own_wait)
    reply[#reply + 1] = 0
    reply[#reply + 1] = until_free
    reply[#reply + 1] = until_free
  end
  for i = 1, rules do
    cost_for(i)
    local state = states[i]
    local own_wait = 0
    if not state.fits then
      local _, period = rule_args(i)
      own_wait = wait(state) or period
    end
    undo(state)
    refused_for(own_wait)
  end
  if guard_window > 0 then
    refused_for(guard_stamp and guard_stamp + guard_window - now or 0)
  end
  if quota then
    refused_for(quota.fits and 0 or quota_wait())
  end
  if in_flight then
    refused_for(in_flight.fits and 0 or slot_frees())
    reply[#reply + 1] = 0
  end
  return reply
end

-- A reservation: a request that may wait is recorded for the time it fits. Never a duplicate, nor
-- past the quota (a calendar day can't be reserved into), nor for a slot (its end isn't known).
local delay = 0
local quota_refused = quota and not quota.fits
local slot_refused = in_flight and not in_flight.fits
if allowed == 0 and not peek and not guard_stamp and not quota_refused and not slot_refused
    and longest_wait and longest_wait <= max_delay then
  allowed = 1
  delay = longest_wait
end

local block_until = 0
local lease_id = 0
if peek then
  for i = 1, rules do
    cost_for(i)
    undo(states[i])
  end
elseif allowed == 1 then
  if in_flight then
    -- The lease is named by the time it was taken (µs), made unique: a number the caller
    -- releases it by. It runs from the request's admission, after its delay.
    local expires = now + delay + lease
    -- (Formatted with %d: Redis would print a number this large in exponent form.)
    lease_id = now_us
    while call('ZADD', in_flight_key, 'NX', expires, string.format('%d', lease_id)) == 0 do
      lease_id = lease_id + 1
    end
    in_flight.held = in_flight.held + 1
    expire_at_least(in_flight_key, expires)
  end
  for i = 1, rules do
    cost_for(i)
    commit(states[i], now + delay, now_us + delay * 1000)
  end
  if guard_window > 0 then
    guard_stamp = now + delay
    call('SET', guard_key, guard_stamp, 'PXAT', guard_stamp + guard_window)
  end
  if quota then
    quota_charge(quota, cost_for(rules + 1))
  end
else
  for i = 1, rules do
    cost_for(i)
    undo(states[i])
  end
  if block > 0 and (refused_by_rules or quota_refused) then
    block_until = now + block
    call('SET', block_key, block_until, 'PXAT', block_until)
  end
end

-- A refusing rule's retry counts to the end of a block it started.
local function retry_of(wait_ms)
  if block_until > 0 and block > wait_ms then
    return block
  end
  return wait_ms
end

local reply = {allowed, delay}
for i = 1, rules do
  cost_for(i)
  local state = states[i]
  local retry = -1
  if allowed == 0 and not state.fits then
    local _, period = rule_args(i)
    retry = retry_of(wait(state) or period)
  end
  local remaining, reset = report(state)
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
  reply[#reply + 1] = retry
end
if guard_window > 0 then
  if guard_stamp then
    local left = guard_stamp + guard_window - now
    reply[#reply + 1] = 0
    reply[#reply + 1] = left
    if allowed == 0 then
      reply[#reply + 1] = retry_of(left)
    else
      reply[#reply + 1] = -1
    end
  else
    reply[#reply + 1] = 1
    reply[#reply + 1] = 0
    reply[#reply + 1] = -1
  end
end
if quota then
  reply[#reply + 1] = math.max(quota_limit - quota.count, 0)
  if quota.count > 0 then
    reply[#reply + 1] = quota.start + quota_day - now
  else
    reply[#reply + 1] = 0
  end
  if allowed == 0 and not quota.fits then
    reply[#reply + 1] = retry_of(quota_wait())
  else
    reply[#reply + 1] = -1
  end
end
if in_flight then
  reply[#reply + 1] = math.max(max_in_flight - in_flight.held, 0)
  local frees = slot_frees()
  reply[#reply + 1] = frees
  if slot_refused then
    reply[#reply + 1] = retry_of(frees)
  else
    reply[#reply + 1] = -1
  end
  reply[#reply + 1] = lease_id
end
-- An admission's receipt: what a give-back of it needs of each counted rule (lua/batch.lua): a
-- token bucket's full time after it (now, when it is full).
if marks_tat and allowed == 1 then
  for i = 1, rules do
    reply[#reply + 1] = math.max(states[i].tat, now_us)
  end
end
for _, percent in ipairs(fired) do
  reply[#reply + 1] = percent
end
return reply
