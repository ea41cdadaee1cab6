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
-- then per request: its algorithm's code, its number of keys, its number of arguments, and its
--                arguments (as lua/head.lua lists them)
--
-- Reply: one flat array (a nested one costs Redis and the client a table and an array per
-- request): per request, in order, the length of its check's reply (see lua/head.lua) and that
-- reply's items, or -1 and the error of a request whose check failed (a key of the wrong type):
-- the others still count.
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

  local out = {}
  local n = 0
  local key_at = 0
  local arg_at = 2
  local last = #ARGV
  -- The key and argument counts of the check being run, nil while they are read.
  local key_count, arg_count

  -- Runs the checks from the one at key_at and arg_at on, writing their replies after out[n].
  local function run_checks()
    while arg_at <= last do
      key_count, arg_count = nil, nil
      local code = ARGV[arg_at]
      local keys, args = number_of(ARGV[arg_at + 1]), number_of(ARGV[arg_at + 2])
      key_count, arg_count = keys, args
      local lean = fast[code]
      if lean and ARGV[arg_at + 4] == '' then
        n = lean(KEYS, ARGV, key_at, keys, arg_at + 3, now, out, n)
      else
        local check_keys = {}
        for i = 1, keys do
          check_keys[i] = KEYS[key_at + i]
        end
        local check_args = {}
        for i = 1, args do
          check_args[i] = ARGV[arg_at + 2 + i]
        end
        local reply = checks[code](check_keys, check_args, now_us)
        out[n + 1] = #reply
        for i = 1, #reply do
          out[n + 1 + i] = reply[i]
        end
        n = n + 1 + #reply
      end
      key_at = key_at + keys
      arg_at = arg_at + 3 + args
    end
  end

  -- One pcall for the run, not one per check: a check that raises an error (a key of the wrong
  -- type) gets it as its reply, and the run goes on after it. A check writes its reply only after
  -- its last Redis command, so a failed one left nothing in `out`.
  while true do
    local ok, failure = pcall(run_checks)
    if ok then
      break
    end
    if key_count == nil then
      return redis.error_reply('malformed batch: ' .. tostring(failure))
    end
    if type(failure) == 'table' and failure.err ~= nil then
      failure = failure.err
    end
    out[n + 1] = -1
    out[n + 2] = tostring(failure)
    n = n + 2
    key_at = key_at + key_count
    arg_at = arg_at + 3 + arg_count
  end
  return out
end
