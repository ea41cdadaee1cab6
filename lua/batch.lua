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
-- ARGV[2]        how many shapes follow: a shape is what the checks of one policy and cost share,
--                sent once per batch rather than once per check (every argument costs Redis about
--                as much as a command in the script)
-- then per shape: its algorithm's code, its number of keys, its number of arguments, and its
--                arguments (as lua/head.lua lists them)
-- then per request, in order: the number of its shape (1-based)
--
-- Reply: one flat array (a nested one costs Redis and the client a table and an array per
-- request; every item costs Redis about as much as an argument): the batch's time (ms), then per
-- request, in order, the length of its entry and the entry's items, which are
--   - an admission's short form (only from lua/fast.lua: two items per rule), remaining and reset
--     per rule: the request was admitted without delay and no rule has a retry;
--   - or the check's reply (see lua/head.lua), which is longer;
-- or -1 and the error of a request whose check failed (a key of the wrong type): the others still
-- count.
local function batch(KEYS, ARGV)
  call, floor = redis.call, math.floor
  numbers, fields = {}, {}
  local now_us
  if ARGV[1] == '' then
    local time = redis.call('TIME')
    now_us = time[1] * 1000000 + time[2]
  else
    now_us = tonumber(ARGV[1])
  end
  local now = floor(now_us / 1000)

  local shapes = {}
  local at = 3
  for s = 1, tonumber(ARGV[2]) do
    local code, keys, arg_count = ARGV[at], tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])
    local args = {}
    for i = 1, arg_count do
      args[i] = ARGV[at + 2 + i]
    end
    local shape = {code = code, keys = keys, args = args}
    -- Without options every key is a counted rule's, and its limit and period follow the cost.
    if fast[code] and args[2] == '' then
      shape.lean, shape.cost, shape.rules = fast[code], tonumber(args[1]), keys
      shape.limits, shape.periods = {}, {}
      for i = 1, keys do
        shape.limits[i], shape.periods[i] = tonumber(args[1 + 2 * i]), tonumber(args[2 + 2 * i])
      end
    end
    shapes[s] = shape
    at = at + 3 + arg_count
  end

  local out = {now}
  local n = 1
  local key_at = 0
  local last = #ARGV
  -- The shape of the check being run, nil while it is read.
  local shape

  -- Runs the checks from the one at key_at and at on, writing their entries after out[n].
  local function run_checks()
    while at <= last do
      shape = nil
      shape = shapes[number_of(ARGV[at])]
      if shape.lean then
        n = shape.lean(KEYS, key_at, shape, now, out, n)
      else
        local check_keys = {}
        for i = 1, shape.keys do
          check_keys[i] = KEYS[key_at + i]
        end
        local reply = checks[shape.code](check_keys, shape.args, now_us)
        out[n + 1] = #reply
        for i = 1, #reply do
          out[n + 1 + i] = reply[i]
        end
        n = n + 1 + #reply
      end
      key_at = key_at + shape.keys
      at = at + 1
    end
  end

  -- One pcall for the run, not one per check: a check that raises an error (a key of the wrong
  -- type) gets it as its entry, and the run goes on after it. A check writes its entry only after
  -- its last Redis command, so a failed one left nothing in `out`.
  while true do
    local ok, failure = pcall(run_checks)
    if ok then
      break
    end
    if shape == nil then
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
  return out
end
