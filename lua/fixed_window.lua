-- Fixed window, every rule of one request in one call: all rules are charged or none is.
--
-- KEYS[i]   the counter of rule i: a hash whose field is the window start (ms) and value the count.
--           All keys of one identity share a hash tag, so the script runs on Redis Cluster.
-- ARGV[1]   the request's cost (units)
-- ARGV[2i]  rule i's limit;  ARGV[2i+1]  rule i's period (ms)
--
-- Reply: {allowed (1|0), now (ms, Redis TIME), then per rule: remaining, reset (ms), retry (ms, -1 if
-- this rule admits the request)}. Windows are aligned to the epoch, as in the in-memory store.
--
-- Each rule is charged with one HINCRBY, which also reads the count: every redis.call costs about as
-- much as the script's own logic, so checking by reading first would double the work of the common,
-- admitted request. If any rule refuses, the charges are taken back before the script returns; the
-- script is atomic, so nobody sees them. A counter that a window's first charge creates gets its
-- expiry in the same call, even when that charge is taken back, so no key outlives its window.
local call = redis.call
local time = call('TIME')
local now = time[1] * 1000 + math.floor(time[2] / 1000)
local cost = tonumber(ARGV[1])
local rules = #KEYS
local reply = {1, now}
for i = 1, rules do
  local period = tonumber(ARGV[2 * i + 1])
  local start = now - now % period
  local count = call('HINCRBY', KEYS[i], start, cost)
  if count == cost then
    call('PEXPIREAT', KEYS[i], start + period)
  end
  local base = 3 * i
  reply[base] = count
  reply[base + 1] = start + period - now
  if count > tonumber(ARGV[2 * i]) then
    reply[1] = 0
  end
end
for i = 1, rules do
  local base = 3 * i
  local limit = tonumber(ARGV[2 * i])
  local count = reply[base]
  local retry = -1
  if reply[1] == 0 then
    local period = tonumber(ARGV[2 * i + 1])
    call('HINCRBY', KEYS[i], now - now % period, -cost)
    if count > limit then
      retry = reply[base + 1]
    end
    count = count - cost
  end
  if count == 0 then
    reply[base + 1] = 0
  end
  local remaining = limit - count
  if remaining < 0 then
    remaining = 0
  end
  reply[base] = remaining
  reply[base + 2] = retry
end
return reply
