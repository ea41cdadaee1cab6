-- The end of the rate-limit script: checks a batch of requests, one after another in the order
-- given, each as if it were a script call of its own (group commit: Redis's fixed cost of a script
-- call and of TIME is paid once per batch). Before this part the store puts lua/common.lua, then
-- per algorithm its check function, `checks.<code> = function(KEYS, ARGV, now_us)` made of
-- lua/head.lua, the algorithm's part (fw: lua/fixed_window.lua, sl: lua/sliding_log.lua,
-- sc: lua/sliding_counter.lua, tb: lua/token_bucket.lua) and lua/tail.lua, then lua/fast.lua (the
-- common case of some algorithms, without options: taken when a check has none).
--
-- All of it is the function `batch(KEYS, ARGV)`: the store registers it as a Redis function
-- (FUNCTION LOAD once, then FCALL: the helpers and check functions are made once, not at every
-- call) or, on a Redis before 7.0 or a cluster, runs it as a script (EVALSHA) whose last line calls
-- it.
--
-- KEYS           every request's keys, request after request (as lua/head.lua lists them)
-- ARGV[1]        empty (the time is Redis TIME), or a time in µs that tests fix
-- ARGV[2]        how many shapes follow
-- then the shapes: what the requests of one policy and cost share, sent once per batch rather
--                than per request (every argument costs Redis about as much as a command in the
--                script), as one piece, `<algorithm's code>|<key count>|<arguments>` with the
--                arguments as lua/head.lua lists them, separated by `|`
-- then per request, in order: the number of its shape (1-based); a give-back's (lua/head.lua's
--                fourth kind) is followed by `@` and its receipt, what its admission's check
--                answered: `<time it was checked (ms)>,<its delay (ms)>` and, for a token bucket,
--                `,<the bucket's full time after it (µs)>` per counted rule
--
-- Reply: one flat array (a nested one costs Redis and the client a table and an array per
-- request; every item costs Redis about as much as an argument), packed as one MessagePack string
-- (`cmsgpack.pack`: it costs Redis what the array as a reply would, and the client reads one
-- string rather than a reply item per number): the batch's time (ms), then per request, in order,
-- its entry, which is
--   - an admission's short form (only from lua/fast.lua): remaining and reset per rule, two items
--     per rule and nothing before them, since the client knows the request's rules: the request
--     was admitted without delay and no rule has a retry;
--   - or the check's reply (see lua/head.lua), which is longer, after its length negated (never
--     -1: a reply has at least 5 items), which no short form starts with (a remaining count);
--   - or -1 and the error of a request whose check failed (a key of the wrong type): the others
--     still count.

-- A shape, parsed from its piece; remembered (see lua/common.lua).
local shape_of = remembered(function(piece)
  local pieces = {}
  for text in string.gmatch(piece .. '|', '([^|]*)|') do
    pieces[#pieces + 1] = text
  end
  local code, keys = pieces[1], tonumber(pieces[2])
  local args = {}
  for i = 3, #pieces do
    args[i - 2] = pieces[i]
  end
  if checks[code] == nil or keys == nil then
    error('malformed shape ' .. piece)
  end
  local shape = {code = code, keys = keys, args = args}
  -- Without options every key is a counted rule's, and its limit and period follow the cost (its
  -- cost per rule is read once here).
  if fast[code] and args[2] == '' then
    shape.lean, shape.rules = fast[code], keys
    shape.costs, shape.limits, shape.periods = {}, {}, {}
    local costs = costs_of(args[1])
    for i = 1, keys do
      shape.costs[i] = costs[i]
      shape.limits[i], shape.periods[i] = tonumber(args[1 + 2 * i]), tonumber(args[2 + 2 * i])
    end
  end
  return shape
end)

-- The batch being run, set by batch() (a library's calls run one at a time): its keys and
-- arguments, its time in ms and µs, the reply so far (`out`, up to item n; a table kept from call
-- to call, its items past n cleared before it is packed, up to `kept`, the last call's n), the
-- next check's first key (after key_at) and shape number (ARGV[at]), and the shape of the check
-- being run (nil while it is read).
local batch_keys, batch_args, now, now_us
local out, n, kept = {}, 0, 0
local key_at, at, shape

-- A request's entry with a receipt (see above): its shape's number, and the receipt's numbers.
local function with_receipt(entry)
  local number, rest = string.match(entry, '^(%d+)@([%d,]+)$')
  local receipt = {}
  for value in string.gmatch(rest, '%d+') do
    receipt[#receipt + 1] = tonumber(value)
  end
  return tonumber(number), receipt
end

-- Runs the checks from the one at key_at and at on, writing their entries after out[n].
local function run_checks()
  local last = #batch_args
  while at <= last do
    shape = nil
    local entry = batch_args[at]
    local number, receipt = number_of(entry), nil
    if number == nil then
      number, receipt = with_receipt(entry)
    end
    shape = shape_of(batch_args[2 + number])
    if shape.lean then
      n = shape.lean(batch_keys, key_at, shape, now, out, n)
    else
      local check_keys = {}
      for i = 1, shape.keys do
        check_keys[i] = batch_keys[key_at + i]
      end
      local reply = checks[shape.code](check_keys, shape.args, now_us, receipt)
      out[n + 1] = -#reply
      for i = 1, #reply do
        out[n + 1 + i] = reply[i]
      end
      n = n + 1 + #reply
    end
    key_at = key_at + shape.keys
    at = at + 1
  end
end

local function batch(KEYS, ARGV)
  call, floor = redis.call, math.floor
  expire_options = redis.REDIS_VERSION_NUM ~= nil
  if ARGV[1] == '' then
    local time = redis.call('TIME')
    now_us = time[1] * 1000000 + time[2]
    clock = floor(now_us / 1000)
  else
    now_us = tonumber(ARGV[1])
    clock = nil
  end
  now = floor(now_us / 1000)
  batch_keys, batch_args = KEYS, ARGV
  out[1], n = now, 1
  key_at, at = 0, 3 + tonumber(ARGV[2])

  -- One pcall for the run, not one per check: a check that raises an error (a key of the wrong
  -- type) gets it as its entry, and the run goes on after it. A check writes its entry only after
  -- its last Redis command, so a failed one left nothing in `out`.
  while true do
    local ok, failure = pcall(run_checks)
    if ok then
      break
    end
    if shape == nil then
      batch_keys, batch_args = nil, nil
      return redis.error_reply('malformed batch: ' .. tostring(failure))
    end
    if type(failure) == 'table' and failure.err ~= nil then
      failure = failure.err
    end
    out[n + 1] = -1
    out[n + 2] = tostring(failure)
    n = n + 2
    key_at = key_at + shape.keys
    at = at + 1
  end
  -- MessagePack takes the table as an array only if nothing follows item n.
  for i = n + 1, kept do
    out[i] = nil
  end
  kept = n
  -- The call's keys and arguments are not kept past it.
  batch_keys, batch_args = nil, nil
  return cmsgpack.pack(out)
end
