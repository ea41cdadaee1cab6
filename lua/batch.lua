-- The end of the rate-limit script: checks a batch of requests, one after another in the order
-- given, each as if it were a script call of its own (group commit: Redis's fixed cost of a script
-- call and of TIME is paid once per batch). Before this part the store puts lua/common.lua, then
-- per algorithm its check function, `checks.<code> = function(KEYS, ARGV, now_us)` made of
-- lua/head.lua, the algorithm's part (fw: lua/fixed_window.lua, sl: lua/sliding_log.lua,
-- sc: lua/sliding_counter.lua, tb: lua/token_bucket.lua) and lua/tail.lua, then lua/fast.lua (the
-- common case of some algorithms, without options: taken when a check has none).
--
-- KEYS           every request's keys, request after request (as lua/head.lua lists them)
-- ARGV[1]        empty (the time is Redis TIME), or a time in µs that tests fix
-- then per request: its algorithm's code, its number of keys, its number of arguments, and its
--                arguments (as lua/head.lua lists them)
--
-- Reply: per request, in order, the reply of its check (see lua/head.lua), or an error reply for a
-- request whose check failed (a key of the wrong type): the others still count.
local now_us
if ARGV[1] == '' then
  local time = redis.call('TIME')
  now_us = time[1] * 1000000 + time[2]
else
  now_us = tonumber(ARGV[1])
end

local replies = {}
local key_at = 0
local arg_at = 2
local last = #ARGV
while arg_at <= last do
  local code = ARGV[arg_at]
  local key_count = tonumber(ARGV[arg_at + 1])
  local arg_count = tonumber(ARGV[arg_at + 2])
  local ok, reply
  if ARGV[arg_at + 4] == '' and fast[code] then
    ok, reply = pcall(fast[code], key_at, key_count, arg_at + 3, now_us)
  else
    local keys = {}
    for i = 1, key_count do
      keys[i] = KEYS[key_at + i]
    end
    local args = {}
    for i = 1, arg_count do
      args[i] = ARGV[arg_at + 2 + i]
    end
    ok, reply = pcall(checks[code], keys, args, now_us)
  end
  key_at = key_at + key_count
  arg_at = arg_at + 3 + arg_count
  if not ok then
    if type(reply) ~= 'table' or reply.err == nil then
      reply = {err = tostring(reply)}
    end
  end
  replies[#replies + 1] = reply
end
return replies
