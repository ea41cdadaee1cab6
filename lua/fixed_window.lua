-- Fixed window, every rule of one request in one call: check all, then record in all or none.
--
-- KEYS[i]   the counter of rule i: a hash {s = window start (ms), c = count}. All keys of one
--           identity share a hash tag, so the script runs on Redis Cluster.
-- ARGV[1]   the request's cost (units)
-- ARGV[2i]  rule i's limit;  ARGV[2i+1]  rule i's period (ms)
--
-- Reply: {allowed (1|0), now (ms, Redis TIME), then per rule: remaining, reset (ms), retry (ms, -1 if
-- this rule admits the request)}. Windows are aligned to the epoch, as in the in-memory store.
local call = redis.call
local time = call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local cost = tonumber(ARGV[1])
local rules = #KEYS

local limits, periods, starts, counts = {}, {}, {}, {}
local allowed = 1
for i = 1, rules do
  local limit, period = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  local start = now - now % period
  local stored = call('HMGET', KEYS[i], 's', 'c')
  local count = 0
  if tonumber(stored[1]) == start then
    count = tonumber(stored[2])
  end
  limits[i], periods[i], starts[i], counts[i] = limit, period, start, count
  if count + cost > limit then
    allowed = 0
  end
end

local reply = {allowed, now}
for i = 1, rules do
  local window_end = starts[i] + periods[i]
  local count = counts[i]
  local retry = -1
  if allowed == 1 then
    if count == 0 then
      -- A new window: the counter and its expiry are written together, so no key outlives its
      -- window; later writes in the window only add to a key that already carries that expiry.
      call('HSET', KEYS[i], 's', starts[i], 'c', cost)
      call('PEXPIREAT', KEYS[i], window_end)
    else
      call('HINCRBY', KEYS[i], 'c', cost)
    end
    count = count + cost
  elseif count + cost > limits[i] then
    retry = window_end - now
  end
  local reset = 0
  if count > 0 then
    reset = window_end - now
  end
  reply[#reply + 1] = math.max(limits[i] - count, 0)
  reply[#reply + 1] = reset
  reply[#reply + 1] = retry
end
return reply
