-- One check of a batch (after the algorithms' parts, before lua/batch.lua): every rule of one
-- request is checked, and recorded in all or none. `run_entry(shape, base, receipt)` runs it; its
-- shape (parsed once per batch or library, see lua/batch.lua) says what the check uses, and it
-- runs only the steps for that: a rule alone costs its algorithm's commands and nothing more, and
-- each option adds its own. Nothing is made per check (no closure, no table but a sliding log's
-- read): what one check finds is kept in this file's tables, by rule, until the next.
--
-- A shape (parsed from the check's arguments, see lua/batch.lua) holds:
--   algorithm      the algorithm's part (lua/fixed_window.lua says what it has), rules (how many
--                  counted rules), limits[i], periods[i], bursts[i] (the limit, but a token
--                  bucket's own), costs[i] and quota_cost (the request's cost in each), ones (the
--                  same, a unit each: what a refund's or an overdraw's answer peeks)
--   max_delay      ms (0: refuse what doesn't fit now; -1: the algorithm can't reserve)
--   guard_window   the duplicate guard's window (ms; 0: none)
--   block          the penalty block (ms; 0: none)
--   quota_limit    0: no quota; quota_day (ms), quota_offset (where days start after epoch-aligned
--                  ones, ms), thresholds (how many alerts), percents[j] and useds[j] (the count
--                  that reaches each)
--   max_in_flight  0: no concurrency limit; lease (a lease's length, ms)
--   kind           what this is: 0 a check, 1 a peek, 2 a refund, 3 a give-back, 4 an overdraw
--   fair_at        0: no budget shared fairly; else the budget's index among the counted rules'
--                  limits, periods and bursts (one past the last rule's), fair_cost (the
--                  request's cost in it), fair_weight (its identity's weight)
--   where its keys are, counted from `base` (the key before its first): counted rule i at i, then
--   guard_at, quota_at, in_flight_at, block_at, marker_at, budget_at, shares_at, tenant_at (0
--   for those it lacks)
-- Its keys (KEYS[base + ...]), in this order, those that apply:
--   the counter of counted rule i (i = 1..rules), in the algorithm's own layout
--   the duplicate guard: a string holding the admission time (ms)
--   the daily quota: a hash from day start (ms) to that day's count, and from `a<percent>`, an
--     alert's flag, to the day start that alert last fired for
--   the concurrency limit's leases: a list of lease ids in expiry order (lua/leases.lua)
--   the penalty block: a string holding the block's end (ms)
--   a give-back's reset marker: the time (ms) the identity was last reset (lua/reset.lua)
--   a budget shared fairly (lua/fair.lua): its counter, in the algorithm's layout; its shares; the
--     tenant's field among them, a key never read as one
--   All keys of one identity share a hash tag, so the script runs on Redis Cluster (a quota keyed
--   like its policy shares it too); under a budget shared fairly, every key of the check has the
--   budget's tag.
-- receipt          a give-back's: where its admission was charged (see lua/batch.lua), nil for
--                  every other kind: {checked (ms), delay (ms), then per counted rule a token
--                  bucket's full time after the charge (µs)}
--
-- A peek (RateLimiter::peek) finds what a check would and writes nothing: no charge, no key, no
-- expiry moved, no block, nothing removed (but what it works out of a budget's shares, its window
-- rolled or its level set, which are the budget's and a check would work out the same: a level is
-- set by whoever asks first, lua/fair.lua). A refund (RateLimiter::refund) gives back `cost` units
-- of the current windows, then answers as a peek of one unit; a give-back (Admitted::refund, a
-- count_only settle, units taken ahead) gives them back only where its receipt says they were
-- charged, and only what is still held of them there. An overdraw (a settle's units used beyond
-- its reservation) charges them past the limits if it must, then answers as a peek of one unit.
--
-- Its entry, written into `out` after item n (see lua/batch.lua) once its last Redis command has
-- run: an admission's short form when it fits (admitted at once, no alert), else, after its
-- length negated, {allowed (1|0), delay (ms to wait before going on), then
-- per rule (the counted rules, then the guard, then the quota): remaining, reset (ms), retry (ms,
-- -1 if this rule admits the request), then, with a concurrency limit, its item (remaining slots,
-- ms until the earliest lease expires, retry), then, with a budget shared fairly, its item and
-- the share's (remaining within the share, and the budget; ms until the window ends; retry), then
-- the lease taken (its id, 0 for none) with a concurrency limit, then the share's limit with a
-- budget (what the identity may use this window while the budget is saturated, else the
-- budget's), then, when admitted, per counted rule and the budget its receipt mark if the
-- algorithm has one (a token bucket's full time, µs), then the percents of the quota alerts this
-- request fired}. Every number is an integer below 2^53, so Lua's doubles hold it exactly.

-- The batch being run (lua/batch.lua sets them): its keys, and its reply so far.
local batch_keys, out

local KIND_CHECK, KIND_PEEK, KIND_REFUND, KIND_GIVE_BACK, KIND_OVERDRAW = 0, 1, 2, 3, 4

-- What the check being run found, per counted rule: whether it fits, and when it would (a
-- refusing rule's wait; false: never).
local fits, waits = {}, {}
-- A refund's or give-back's per counted rule: whether a peek of one unit fits after it, or nil
-- when the algorithm left it to be read.
local given = {}
-- During a penalty block, each item's own wait (the counted rules', then the guard's, the
-- quota's, the concurrency limit's).
local blocked_waits = {}
-- The quota's alerts the check fired.
local fired, fired_count = {}, 0
-- Under a budget shared fairly, what the check found (written by write_fair): whether it asked
-- for its own units (a check or a peek; else a peek of one unit after a give-back), whether the
-- budget fits and its wait when not, the identity's share (its cap, nil while the budget isn't
-- saturated; what it used; ms until the window ends) and whether the request fits in it.
local fair_asking, budget_fits, budget_wait = false, true, 0
local share_cap, share_used, share_resets, share_fits = nil, 0, 0, true
-- (Defined after write_item.)
local write_fair, write_share_limit
-- The end (ms) of each penalty block the batch has read or set (0: none), by key: a flood's checks
-- of one batch read it once (why that holds: logs_known, lua/common.lua). Forgotten at each
-- batch.
local block_known = {}

local function forget_blocks()
  if next(block_known) ~= nil then
    block_known = {}
  end
end

-- The end (ms) of the block `key` holds, 0 for none, read once per batch.
local function block_end(key)
  local ends = block_known[key]
  if ends == nil then
    ends = tonumber(call('GET', key)) or 0
    block_known[key] = ends
  end
  return ends
end

-- What a lean function (lua/fast.lua) charged already of the check it leaves to run_entry: its
-- first rule's fixed-window count after the charge, and the quota's count after its charge (nil:
-- nothing). run_entry takes them rather than charging again, so a refusal costs what it would
-- have without the lean path.
local handed_count, handed_quota = nil, nil

-- The time (ms) of each identity's last reset the batch has read (false: none), by its marker's
-- key (lua/reset.lua sets it, never during a batch): the give-backs of one batch read it once.
-- Forgotten at each batch.
local markers_known = {}

local function forget_markers()
  if next(markers_known) ~= nil then
    markers_known = {}
  end
end

-- Whether a give-back of `receipt` gives its units back to the counted rules: not after a reset
-- (its marker at `marker_key`) that came at or after the charge, since their counts since hold
-- nothing of it (the quota, never reset, still may).
local function gives_back(marker_key, receipt)
  local reset_at = markers_known[marker_key]
  if reset_at == nil then
    reset_at = tonumber(call('GET', marker_key)) or false
    markers_known[marker_key] = reset_at
  end
  return not reset_at or reset_at < receipt[1]
end

-- The start of the quota's day that `at` (ms) falls in.
local function quota_day_start(shape, at)
  local day = shape.quota_day
  return at - (at + day - shape.quota_offset % day) % day
end

-- A quota's day charged for the first time (once a day per key): the key lives to the day's end,
-- and when it outlived an earlier day (a quota used every day) the counts of the days before the
-- last go (the last one's is kept for a clock that steps back into it), so a quota used every day
-- holds two days' counts, not one per day it has lived through, however many an earlier version
-- left. Its alerts' flags (`a<percent>`) stay.
local function quota_day_opened(key, start, day)
  if expire_at_least(key, start + day) then
    local fields = call('HKEYS', key)
    for j = 1, #fields do
      local day_start = tonumber(fields[j])
      if day_start and day_start < start - day then
        call('HDEL', key, fields[j])
      end
    end
  end
end

-- The quota days the batch has read or charged, by key and day start (why they hold:
-- logs_known, lua/common.lua): {the count, the count Redis holds, the day's length}. The first
-- charge of a day in a batch goes to Redis at once (a key one request a batch charges costs what
-- it did); the batch's later charges and give-backs of it are counted here and written in one
-- command when the batch ends, or before anything else reads or writes the key (quota_flush): a
-- hot identity's checks of one batch charge its quota in two commands, not one each.
local quota_days = {}

local function forget_quotas()
  if next(quota_days) ~= nil then
    quota_days = {}
  end
end

-- Writes what the batch counted of `key`'s days and Redis doesn't hold yet.
local function quota_flush(key)
  local days = quota_days[key]
  if days == nil then
    return
  end
  for start, known in pairs(days) do
    local count, stored = known[1], known[2]
    if count ~= stored then
      local field = text_of(start)
      if count == 0 then
        -- (A day's count of 0 is no count: the field goes, as a give-back to 0 leaves it.)
        call('HDEL', key, field)
      elseif call('HINCRBY', key, field, text_of(count - stored)) == count - stored then
        quota_day_opened(key, start, known[3])
      end
      known[2] = count
    end
  end
end

-- quota_flush of every key the batch counted: at its end.
local function flush_quotas()
  if next(quota_days) ~= nil then
    for key in pairs(quota_days) do
      quota_flush(key)
    end
  end
end

-- The batch's count of the quota `key`'s day starting at `start` (see quota_days), read from Redis
-- (`units` nil) or charged `units` there when the batch hasn't met the day yet; nil when it has.
local function quota_day(shape, key, start, units)
  local days = quota_days[key]
  if days == nil then
    days = {}
    quota_days[key] = days
  end
  local known = days[start]
  if known ~= nil then
    return known
  end
  local count
  if units == nil then
    local text = call('HGET', key, text_of(start))
    if not integer_text(text) then
      error(NOT_AN_INTEGER) -- (quota_flush would move it with HINCRBY)
    end
    count = tonumber(text) or 0
  else
    count = call('HINCRBY', key, text_of(start), text_of(units))
    if count == units then
      quota_day_opened(key, start, shape.quota_day)
    end
  end
  days[start] = {count, count, shape.quota_day}
  return nil
end

-- Charges `units` to the quota's day starting at `start` (negative: takes a charge back); returns
-- the count after. A day's first charge makes the key live to the day's end.
local function quota_add(shape, key, start, units)
  local known = quota_day(shape, key, start, units)
  if known == nil then
    return quota_days[key][start][1]
  end
  known[1] = known[1] + units
  return known[1]
end

-- The count of the quota's day starting at `start`.
local function quota_read(shape, key, start)
  local known = quota_day(shape, key, start, nil) or quota_days[key][start]
  return known[1]
end

-- Takes up to `units` back from the quota's day starting at `start`, never below zero.
local function quota_take_back(shape, key, start, units)
  local known = quota_day(shape, key, start, nil) or quota_days[key][start]
  known[1] = math.max(known[1] - units, 0)
end

-- The day's quota count went from `before` to `after` (a charge of the key `quota_key` for the
-- day starting at `start`): fires the alerts whose threshold it reached first, once per key,
-- threshold and day (the alert's flag, a field of the quota's hash, holds the day it fired for,
-- and lives as long as the day's count).
local function quota_alerts(shape, quota_key, start, before, after)
  for j = 1, shape.thresholds do
    local used = shape.useds[j]
    if before < used and after >= used then
      local flag = shape.alert_fields[j]
      -- (The day's count first: a flag never makes a key the count's expiry hasn't reached.)
      quota_flush(quota_key)
      if tonumber(call('HGET', quota_key, flag)) ~= start then
        call('HSET', quota_key, flag, text_of(start))
        fired_count = fired_count + 1
        fired[fired_count] = shape.percents[j]
      end
    end
  end
end

-- Ends the full reply begun after out[start] and written up to out[n]: the percents of the alerts
-- the check fired, then its length, negated, before it. Returns the index of its last item.
local function end_entry(start, n)
  for j = 1, fired_count do
    out[n + j] = fired[j]
  end
  n = n + fired_count
  out[start + 1] = start + 1 - n
  return n
end

-- The block's reply: every item refused until the later of the block's end and the time it would
-- admit the request itself (a client that waits as long as Retry-After says must not find a rule
-- still full, and be refused and blocked anew); written once every command ran.
local function write_blocked(shape, blocked_for, own_waits, n)
  local items = shape.rules + (shape.guard_window > 0 and 1 or 0) + (shape.quota_limit > 0 and 1 or 0)
                + (shape.max_in_flight > 0 and 1 or 0)
  local start = n
  out[n + 2], out[n + 3] = 0, 0
  n = n + 3
  for k = 1, items do
    local until_free = math.max(blocked_for, own_waits[k])
    out[n + 1], out[n + 2], out[n + 3] = 0, until_free, until_free
    n = n + 3
  end
  if shape.fair_at > 0 then
    n = write_fair(shape, n, false, 0)
  end
  if shape.max_in_flight > 0 then
    out[n + 1] = 0
    n = n + 1
  end
  if shape.fair_at > 0 then
    n = write_share_limit(shape, n)
  end
  -- (With the alerts an overdraw fired before the block answered.)
  return end_entry(start, n)
end

-- A refusing item's retry (ms), which counts to the end of a block its refusal started
-- (`block`: the block's length, 0 when none started).
local function retry_of(wait_ms, block)
  if block > wait_ms then
    return block
  end
  return wait_ms
end

-- Writes an item's remaining and reset after out[n], and in the full reply (not `short`) its
-- retry; returns the index of its last number.
local function write_item(n, short, remaining, reset, retry)
  out[n + 1], out[n + 2] = remaining, reset
  if short then
    return n + 2
  end
  out[n + 3] = retry
  return n + 3
end

-- Under a budget shared fairly (shape.fair_at > 0), writes its item and the share's after out[n]
-- (see above: the share's remaining is within the budget's too), for a check answered `allowed`;
-- returns the index of the last number.
function write_fair(shape, n, short, allowed)
  local at = shape.fair_at
  local remaining, reset = shape.algorithm.report(shape, at)
  local refused = allowed == 0 and fair_asking
  n = write_item(n, short, remaining, reset, (refused and not budget_fits) and budget_wait or -1)
  local left = remaining
  if share_cap then
    -- (What a check admitted used; a peek, as the rules' reports, says what is left.)
    local used = share_used + (allowed == 1 and shape.kind == KIND_CHECK and shape.fair_cost or 0)
    left = math.min(math.max(share_cap - used, 0), remaining)
  end
  return write_item(n, short, left, share_resets, (refused and not share_fits) and share_resets
                    or -1)
end

-- Under a budget shared fairly, writes the share's limit after out[n] (what the identity may
-- use this window, or the budget's while it isn't saturated); returns the index of the last
-- number.
function write_share_limit(shape, n)
  out[n + 1] = share_cap or shape.limits[shape.fair_at]
  return n + 1
end

-- Runs the check of `shape` whose keys follow KEYS[base], writing its entry after out[n];
-- returns the index of its last item.
local function run_entry(shape, base, receipt, n)
  local algorithm, rules, kind = shape.algorithm, shape.rules, shape.kind
  local keys = batch_keys
  local costs, quota_cost = shape.costs, shape.quota_cost
  local quota_limit, max_in_flight = shape.quota_limit, shape.max_in_flight
  local giving_back = kind == KIND_GIVE_BACK
  local peeking = kind ~= KIND_CHECK
  fired_count = 0
  local handed_rule, handed_day = handed_count, handed_quota
  handed_count, handed_quota = nil, nil
  -- A budget shared fairly (lua/fair.lua): its index among the rules' numbers, its keys, the
  -- request's cost in it; what it gave back for a peek of one unit (nil: to be read).
  local fair_at, fair_cost = shape.fair_at, shape.fair_cost
  local budget_key, shares_key, tenant, budget_given
  if fair_at > 0 then
    budget_key, shares_key = keys[base + shape.budget_at], keys[base + shape.shares_at]
    tenant = keys[base + shape.tenant_at]
  end

  -- Whether the counted rules get anything back: not after a reset that came at or after the
  -- charge (their counts since hold nothing of it; the quota, never reset, still may).
  local rules_give_back = true
  if giving_back then
    if receipt == nil then
      error('a give-back without its receipt')
    end
    rules_give_back = gives_back(keys[base + shape.marker_at], receipt)
  end

  -- A penalty block refuses everything until it ends: the time it has left.
  local blocked_for = 0
  if shape.block > 0 then
    blocked_for = math.max(block_end(keys[base + shape.block_at]) - now, 0)
  end

  -- The duplicate guard: the time of the last admission, while it is less than a window ago.
  local guard_stamp = nil
  if shape.guard_window > 0 then
    guard_stamp = tonumber(call('GET', keys[base + shape.guard_at]))
    if guard_stamp and guard_stamp + shape.guard_window <= now then
      guard_stamp = nil
    end
  end

  local quota_key = quota_limit > 0 and keys[base + shape.quota_at] or nil

  -- A refund gives back its units in every counted rule and the day's quota, then answers as a
  -- peek of one unit.
  -- (Per counted rule, what its give-back left for the peek: nil when the rule must be read.)
  local peeked = false
  if kind == KIND_REFUND or giving_back then
    if rules_give_back then
      for i = 1, rules do
        given[i] = algorithm.give_back(shape, i, keys[base + i], costs[i], receipt)
      end
      peeked = true
    end
    -- The quota's units go back to the day that was charged, while it lasts.
    if quota_key and (not giving_back
                      or quota_day_start(shape, receipt[1]) == quota_day_start(shape, now)) then
      quota_take_back(shape, quota_key, quota_day_start(shape, now), quota_cost)
    end
    -- The budget's, where they were charged (a reset of the identity doesn't reach it), and the
    -- share's of this window.
    if fair_at > 0 then
      budget_given = algorithm.give_back(shape, fair_at, budget_key, fair_cost, receipt)
      fair_give_back(shares_key, tenant, shape.periods[fair_at], fair_cost,
                     giving_back and receipt[1] or now)
    end
    costs, quota_cost = shape.ones, 1
  elseif kind == KIND_OVERDRAW then
    -- Every counted rule and the quota charged in their current windows without a check, each
    -- by at most its limit (a token bucket's burst).
    for i = 1, rules do
      local cost = math.min(costs[i], shape.bursts[i])
      if cost > 0 then
        local key = keys[base + i]
        algorithm.inspect(shape, i, key, cost, false)
        algorithm.commit(shape, i, key, cost, now, now_us)
      end
    end
    if quota_key then
      local units = math.min(quota_cost, quota_limit)
      if units > 0 then
        local start = quota_day_start(shape, now)
        local after = quota_add(shape, quota_key, start, units)
        quota_alerts(shape, quota_key, start, after - units, after)
      end
    end
    if fair_at > 0 then
      local units = math.min(fair_cost, shape.bursts[fair_at])
      if units > 0 then
        algorithm.inspect(shape, fair_at, budget_key, units, false)
        algorithm.commit(shape, fair_at, budget_key, units, now, now_us)
        local _, _, _, shares = fair_share(shares_key, tenant, shape.limits[fair_at],
                                           shape.periods[fair_at], nil, 0)
        fair_count(shares, tenant, units, true)
      end
    end
    costs, quota_cost = shape.ones, 1
  end

  local allowed = guard_stamp and 0 or 1
  local refused_by_rules = false
  -- The wait until every refusing rule admits the request; nil when one never will.
  local longest_wait = 0
  for i = 1, rules do
    local cost = costs[i]
    local fit
    if peeked and given[i] ~= nil then
      fit = given[i]
    elseif i == 1 and handed_rule then
      fit = algorithm.charged(shape, 1, handed_rule)
    else
      fit = algorithm.inspect(shape, i, keys[base + i], cost, peeking)
    end
    fits[i] = fit
    if not fit then
      allowed = 0
      refused_by_rules = true
      local rule_wait = algorithm.wait(shape, i, cost, keys[base + i])
      waits[i] = rule_wait or false
      if rule_wait == nil or longest_wait == nil then
        longest_wait = nil
      elseif rule_wait > longest_wait then
        longest_wait = rule_wait
      end
    end
  end

  -- A budget shared fairly and the identity's share of it (lua/fair.lua): a check or a peek asks
  -- for its own units, any other call peeks at one. Either refusing refuses the request, and no
  -- reservation waits for them.
  local fair_refused, shares = false, nil
  if fair_at > 0 then
    fair_asking = kind == KIND_CHECK or kind == KIND_PEEK
    local asked = fair_asking and fair_cost or 0
    share_cap, share_used, share_resets, shares = fair_share(shares_key, tenant,
      shape.limits[fair_at], shape.periods[fair_at],
      kind == KIND_CHECK and shape.fair_weight or nil, asked)
    if budget_given ~= nil then
      budget_fits = budget_given
    else
      budget_fits = algorithm.inspect(shape, fair_at, budget_key, fair_asking and fair_cost or 1,
                                      peeking)
    end
    share_fits = not share_cap or share_used + asked <= share_cap
    if fair_asking and not budget_fits then
      budget_wait = algorithm.wait(shape, fair_at, fair_cost, budget_key) or shape.periods[fair_at]
      -- While shares bind, no later than the window's end: a tenant held back asks again when
      -- the next window's shares are set (a caller that waits for room included).
      if share_cap and budget_wait > share_resets then
        budget_wait = share_resets
      end
    end
    if fair_asking and not (budget_fits and share_fits) then
      allowed = 0
      fair_refused = true
    end
  end

  -- The daily quota: a fixed window of one day, starting at the quota's midnight. A check that
  -- may still be admitted (now, or after a delay) charges it at once (one command, as a fixed
  -- window's rule), and takes the charge back if the request is refused; one refused already (a
  -- flood's) only reads it.
  local quota_start, quota_count, quota_fits, quota_charged = 0, 0, true, false
  if quota_key then
    quota_start = quota_day_start(shape, now)
    local admissible = allowed == 1
      or (not guard_stamp and not fair_refused and longest_wait and longest_wait <= shape.max_delay)
    if handed_day then
      -- (Charged by the lean function, whose rules admitted the request: it is admissible.)
      quota_count, quota_charged = handed_day - quota_cost, true
    elseif peeking or blocked_for > 0 or not admissible then
      quota_count = quota_read(shape, quota_key, quota_start)
    else
      quota_count = quota_add(shape, quota_key, quota_start, quota_cost) - quota_cost
      quota_charged = true
    end
    quota_fits = quota_count + quota_cost <= quota_limit
    if not quota_fits then
      allowed = 0
    end
  end

  -- The concurrency limit: leases past their expiry are gone (their requests ended without a
  -- word, their instance died), the others each hold a slot; `earliest`, when the first of them
  -- expires (nil: none is held).
  local in_flight_key, held, earliest, slot_fits = nil, 0, nil, true
  if max_in_flight > 0 then
    in_flight_key = keys[base + shape.in_flight_at]
    if peeking then
      held, earliest = leases_peek(in_flight_key)
    else
      held, earliest = leases_current(in_flight_key)
    end
    slot_fits = held < max_in_flight
    if not slot_fits then
      allowed = 0
    end
  end

  -- When a refused quota admits the request: at the end of its day, or (a cost above its limit,
  -- which no day admits) a day from now.
  local quota_wait = 0
  if not quota_fits then
    quota_wait = quota_cost > quota_limit and shape.quota_day
                 or quota_start + shape.quota_day - now
  end

  if blocked_for > 0 then
    -- During a penalty block nothing is admitted or counted.
    local own_waits = blocked_waits
    for i = 1, rules do
      own_waits[i] = fits[i] and 0 or (waits[i] or shape.periods[i])
      algorithm.undo(shape, i, keys[base + i], costs[i], peeking)
    end
    if fair_at > 0 then
      algorithm.undo(shape, fair_at, budget_key, fair_asking and fair_cost or 1, peeking)
    end
    local at = rules
    if shape.guard_window > 0 then
      at = at + 1
      own_waits[at] = guard_stamp and guard_stamp + shape.guard_window - now or 0
    end
    if quota_key then
      at = at + 1
      own_waits[at] = quota_wait
    end
    if in_flight_key then
      at = at + 1
      own_waits[at] = (not slot_fits and earliest) and math.max(earliest - now, 0) or 0
    end
    return write_blocked(shape, blocked_for, own_waits, n)
  end

  -- A reservation: a request that may wait is recorded for the time it fits. Never a duplicate,
  -- nor past the quota (a calendar day can't be reserved into), nor for a slot (its end isn't
  -- known).
  local delay = 0
  if allowed == 0 and not peeking and not guard_stamp and quota_fits and slot_fits
      and not fair_refused and longest_wait and longest_wait <= shape.max_delay then
    allowed = 1
    delay = longest_wait
  end

  local block_until = 0
  local lease_id = 0
  if allowed == 1 and not peeking then
    if in_flight_key then
      -- It runs from the request's admission, after its delay.
      lease_id, held, earliest =
        lease_take(in_flight_key, held, earliest, now + delay + shape.lease)
    end
    for i = 1, rules do
      algorithm.commit(shape, i, keys[base + i], costs[i], now + delay, now_us + delay * 1000)
    end
    if shape.guard_window > 0 then
      guard_stamp = now + delay
      call('SET', keys[base + shape.guard_at], guard_stamp, 'PXAT',
           guard_stamp + shape.guard_window)
    end
    if quota_charged then
      quota_alerts(shape, quota_key, quota_start, quota_count, quota_count + quota_cost)
      quota_count = quota_count + quota_cost
    end
    if fair_at > 0 then
      algorithm.commit(shape, fair_at, budget_key, fair_cost, now + delay, now_us + delay * 1000)
      fair_count(shares, tenant, fair_cost, true)
    end
  else
    for i = 1, rules do
      algorithm.undo(shape, i, keys[base + i], costs[i], peeking)
    end
    if quota_charged then
      quota_add(shape, quota_key, quota_start, 0 - quota_cost)
    end
    if fair_at > 0 then
      algorithm.undo(shape, fair_at, budget_key, fair_asking and fair_cost or 1, peeking)
      -- Refused by the budget or the share alone, a check still asked: demand counts.
      if kind == KIND_CHECK and not refused_by_rules and not guard_stamp and quota_fits
          and slot_fits then
        fair_count(shares, tenant, fair_cost, false)
      end
    end
    if shape.block > 0 and not peeking and (refused_by_rules or not quota_fits) then
      block_until = now + shape.block
      local block_key = keys[base + shape.block_at]
      call('SET', block_key, text_of(block_until), 'PXAT', text_of(block_until))
      block_known[block_key] = block_until
    end
  end

  -- Every command has run: the entry. A refusing rule's retry counts to the end of a block it
  -- started.
  local block = block_until > 0 and shape.block or 0
  local marks = algorithm.marks and allowed == 1
  -- An admission at once with no alert to say takes the short form.
  local short = allowed == 1 and delay == 0 and fired_count == 0
  local start = n
  if not short then
    out[n + 2], out[n + 3] = allowed, delay
    n = n + 3
  end
  for i = 1, rules do
    local remaining, reset = algorithm.report(shape, i)
    n = write_item(n, short, remaining, reset, (allowed == 0 and not fits[i])
                                      and retry_of(waits[i] or shape.periods[i], block) or -1)
  end
  if shape.guard_window > 0 then
    if guard_stamp then
      local left = guard_stamp + shape.guard_window - now
      n = write_item(n, short, 0, left, allowed == 0 and retry_of(left, block) or -1)
    else
      n = write_item(n, short, 1, 0, -1)
    end
  end
  if quota_key then
    n = write_item(n, short, math.max(quota_limit - quota_count, 0),
                   quota_count > 0 and quota_start + shape.quota_day - now or 0,
                   (allowed == 0 and not quota_fits) and retry_of(quota_wait, block) or -1)
  end
  if in_flight_key then
    local frees = earliest and math.max(earliest - now, 0) or 0
    n = write_item(n, short, math.max(max_in_flight - held, 0), frees,
                   slot_fits and -1 or retry_of(frees, block))
  end
  if fair_at > 0 then
    n = write_fair(shape, n, short, allowed)
  end
  if in_flight_key then
    out[n + 1] = lease_id
    n = n + 1
  end
  if fair_at > 0 then
    n = write_share_limit(shape, n)
  end
  if marks then
    for i = 1, rules do
      out[n + 1] = algorithm.mark(i)
      n = n + 1
    end
    if fair_at > 0 then
      out[n + 1] = algorithm.mark(fair_at)
      n = n + 1
    end
  end
  if short then
    return n
  end
  return end_entry(start, n)
end
