-- The start of every check (lua/batch.lua makes one function of this, an algorithm's part and
-- lua/tail.lua per algorithm: `function(KEYS, ARGV, now_us, receipt)`, called once per request of
-- a batch). Every rule of one request is checked, and recorded in all or none.
--
-- now_us         the batch's time (µs, Redis TIME): every request of a batch is checked at it
-- receipt        a give-back's: where its admission was charged (see lua/batch.lua), nil for
--                every other kind: {checked (ms), delay (ms), then per counted rule a token
--                bucket's full time after the charge (µs)}
-- KEYS[i]        the counter of counted rule i (i = 1..n), in the algorithm's own layout
-- then, in this order, only those that apply:
--   the duplicate guard: a string holding the admission time (ms)
--   the daily quota: a hash from day start (ms) to that day's count
--   one alert flag per quota threshold: a string holding the day start it last fired for
--   the concurrency limit's leases: a sorted set of lease ids scored by their expiry (ms)
--   the penalty block: a string holding the block's end (ms)
--   a give-back's reset marker (always the last key of a give-back): the time (ms) the identity
--   was last reset (lua/reset.lua)
--                All keys of one identity share a hash tag, so the script runs on Redis Cluster
--                (a quota keyed like its policy shares it too).
-- ARGV[1]        the request's cost (units), or `<cost>:<units>:<flags>` when a rule or the quota
--                counts metered units (see costs_of, lua/common.lua)
-- ARGV[2]        the options, comma-separated, or empty when there are none (the common case: every
--                argument costs Redis about as much as a command, so they are packed):
--                max delay (ms; 0: refuse what doesn't fit now), duplicate guard window (ms; 0:
--                none), penalty block (ms; 0: none), quota limit (0: no quota), quota day length
--                (ms), where quota days start after epoch-aligned ones (ms), most requests in
--                flight at once (0: no concurrency limit), a lease's length (ms), what this is (0: a
--                check, 1: a peek, 2: a refund, 3: a give-back, 4: an overdraw), then per alert
--                threshold:
--                percent, count that reaches it
-- then per counted rule, from ARGV[3]: limit, period (ms), and for the token bucket its burst
--
-- Returns {allowed (1|0), delay (ms to wait before going on), then per rule (the counted rules,
-- then the guard, then the quota): remaining, reset (ms), retry (ms, -1 if this rule admits the
-- request), then, with a concurrency limit, its item (remaining slots, ms until the earliest
-- lease expires, retry) and the lease taken (its id, 0 for none), then, when admitted, per
-- counted rule its receipt mark if the algorithm has one (a token bucket's full time, µs), then
-- the percents of the quota alerts this request fired}; the time it was checked at
-- is the batch's, which lua/batch.lua replies once. Every number is an integer below 2^53, so
-- Lua's doubles hold it exactly.
local now = floor(now_us / 1000)
-- Each counted rule's cost, and the quota's (at rules + 1); `cost` is the one being counted,
-- which cost_for sets (the algorithm's part reads it).
local costs = costs_of(ARGV[1])
local cost = costs[1]
local function cost_for(i)
  cost = costs[i]
  return cost
end
local options = {}
if ARGV[2] ~= '' then
  for number in string.gmatch(ARGV[2], '%d+') do
    options[#options + 1] = tonumber(number)
  end
end
local max_delay = options[1] or 0
local guard_window = options[2] or 0
local block = options[3] or 0
local quota_limit = options[4] or 0
local quota_day = options[5] or 0
local quota_offset = options[6] or 0
local max_in_flight = options[7] or 0
local lease = options[8] or 0
-- A peek (RateLimiter::peek) finds what a check would and writes nothing: no charge, no key, no
-- expiry moved, no block, nothing removed. A refund (RateLimiter::refund) gives back `cost`
-- units of the current windows (lua/tail.lua), then answers as a peek of one unit; a give-back
-- (Admitted::refund, a count_only settle, units taken ahead) gives them back only where its
-- receipt says they were charged, and only what is still held of them there.
local giving_back = options[9] == 3
if giving_back and receipt == nil then
  error('a give-back without its receipt')
end
local refunding = options[9] == 2 or giving_back
-- An overdraw (a settle's units used beyond its reservation) charges them past the limits if it
-- must (lua/tail.lua), then answers as a peek of one unit.
local overdrawing = options[9] == 4
local peek = options[9] == 1 or refunding or overdrawing
local thresholds = math.max(floor((#options - 9) / 2), 0)
-- Arguments per counted rule: limit and period; the token bucket's part sets 3 (and a burst).
local rule_arity = 2
-- Whether an admission's reply carries a receipt mark per counted rule: the token bucket's part
-- sets it (its full time after the charge; a flag, not a function: no closure per check).
local marks_tat = false
local extra_keys = 0
if guard_window > 0 then
  extra_keys = extra_keys + 1
end
if quota_limit > 0 then
  extra_keys = extra_keys + 1 + thresholds
end
if max_in_flight > 0 then
  extra_keys = extra_keys + 1
end
if block > 0 then
  extra_keys = extra_keys + 1
end
if giving_back then
  extra_keys = extra_keys + 1
end
local rules = #KEYS - extra_keys
local next_key = rules + 1
local guard_key = nil
if guard_window > 0 then
  guard_key = KEYS[next_key]
  next_key = next_key + 1
end
local quota_key = nil
local flags_from = nil
if quota_limit > 0 then
  quota_key = KEYS[next_key]
  flags_from = next_key + 1
end
-- The keys after the quota's, counted from the last.
local last_key = #KEYS
local marker_key = nil
if giving_back then
  marker_key = KEYS[last_key]
  last_key = last_key - 1
end
local block_key = KEYS[last_key]
local in_flight_key = nil
if max_in_flight > 0 then
  in_flight_key = KEYS[last_key - (block > 0 and 1 or 0)]
end

-- Alert threshold j's percent and the count that reaches it.
local function threshold(j)
  return options[9 + 2 * j - 1], options[9 + 2 * j]
end

-- Counted rule i's limit, period and burst (the limit, unless the rule has its own).
local function rule_args(i)
  local base = 3 + rule_arity * (i - 1)
  local limit = tonumber(ARGV[base])
  if rule_arity == 3 then
    return limit, tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2])
  end
  return limit, tonumber(ARGV[base + 1]), limit
end

-- The start of the quota's day that `at` (ms; by default now) falls in.
local function quota_day_start(at)
  at = at or now
  return at - (at + quota_day - quota_offset % quota_day) % quota_day
end

-- A give-back's charge: when it was checked (ms; the window and day it charged) and when it was
-- admitted (ms); counted rule i's mark (a token bucket's full time after it, µs) is
-- receipt[2 + i].
local charged_at, admitted_at = nil, nil
-- Whether the counted rules get anything back: not after a reset that came at or after the
-- charge (their counts since hold nothing of it; the quota, never reset, still may).
local rules_give_back = true
if giving_back then
  charged_at, admitted_at = receipt[1], receipt[1] + receipt[2]
  local reset_at = tonumber(call('GET', marker_key))
  rules_give_back = reset_at == nil or reset_at < charged_at
end

-- A penalty block refuses everything until it ends (lua/tail.lua answers it): the time it has left.
local blocked_for = 0
if block > 0 then
  blocked_for = math.max((tonumber(call('GET', block_key)) or 0) - now, 0)
end

-- The duplicate guard: the time of the last admission, while it is less than a window ago.
local guard_stamp = nil
if guard_window > 0 then
  guard_stamp = tonumber(call('GET', guard_key))
  if guard_stamp and guard_stamp + guard_window <= now then
    guard_stamp = nil
  end
end

-- The algorithm's part defines, for one counted rule:
--   give_back(i, limit, period, burst)          a refund: give back `cost` units of the current
--                                               window, never below zero; a give-back
--                                               (`giving_back`): only where the receipt says
--   inspect(i, limit, period, burst) -> state   read the counter (it may charge it speculatively);
--                                               state.fits: whether the rule admits the request now
--   wait(state) -> ms | nil                     when it would (nil: never, it costs too much)
--   commit(state, at_ms, at_us)                 record the request as admitted at `at`
--   undo(state)                                 take back a speculative charge
--   report(state) -> remaining, reset (ms)
