-- Fixed window, every rule of one request in one call: check all, then record in all or none.
--
-- KEYS[i]   the counter of rule i: a hash {s = window start (ms), c = count}. All keys of one
--           identity share a hash tag, so the script runs on Redis Cluster.
-- ARGV[1]   the request's cost (units)
-- ARGV[2i]  rule i's limit;  ARGV[2i+1]  rule i's period (ms)
--
-- Reply: {allowed (1|0), now (ms, Redis TIME), then per rule: remaining, reset (ms), retry (ms, -1 if
-- this rule admits the request)}. Windows are aligned to the epoch, as in the in-memory store.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local cost = tonumber(ARGV[1])
local rules = #KEYS

local starts, counts = {}, {}
local allowed = 1
for i = 1, rules do
  local limit = tonumber(ARGV[2 * i])
  local period = tonumber(ARGV[2 * i + 1])
  local start = now - (now % period)
  local stored = redis.call('HMGET', KEYS[i], 's', 'c')
  local count = 0
  if tonumber(stored[1]) == start then
    count = tonumber(stored[2]) or 0
  end
  starts[i], counts[i] = start, count
  if count + cost > limit then
    allowed = 0
  end
end

local reply = {allowed, now}
for i = 1, rules do
  local limit = tonumber(ARGV[2 * i])
  local period = tonumber(ARGV[2 * i + 1])
  local window_end = starts[i] + period
  local count = counts[i]
  local retry = -1
  if allowed == 1 then
    count = count + cost
    redis.call('HSET', KEYS[i], 's', starts[i], 'c', count)
    -- The expiry comes with the write, so no key outlives its window.
    redis.call('PEXPIREAT', KEYS[i], window_end)
  elseif count + cost > limit then
    retry = window_end - now
  end
  local reset = 0
  if count > 0 then
    reset = window_end - now
  end
  reply[#reply + 1] = math.max(limit - count, 0)
  reply[#reply + 1] = reset
  reply[#reply + 1] = retry
end
return reply
