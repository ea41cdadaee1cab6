-- Sliding-window log, every rule of one request in one call: check all, then record in all or none.
--
-- KEYS[i]   the log of rule i: a sorted set of admissions scored by time (ms). All keys of one
--           identity share a hash tag, so the script runs on Redis Cluster.
-- ARGV[1]   the request's cost (units; one member each)
-- ARGV[2i]  rule i's limit;  ARGV[2i+1]  rule i's period (ms)
--
-- Reply: {allowed (1|0), now (ms, Redis TIME), then per rule: remaining, reset (ms), retry (ms, -1 if
-- this rule admits the request)}. An admission at t counts while t + period > now, as in the
-- in-memory store; a log never holds more than its rule's limit of members.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local cost = tonumber(ARGV[1])
local rules = #KEYS

local counts = {}
local allowed = 1
for i = 1, rules do
  local limit = tonumber(ARGV[2 * i])
  local period = tonumber(ARGV[2 * i + 1])
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now - period)
  counts[i] = redis.call('ZCARD', KEYS[i])
  if counts[i] + cost > limit then
    allowed = 0
  end
end

-- The score of the n-th oldest admission (1-based), or nil.
local function nth_oldest(key, n)
  local found = redis.call('ZRANGE', key, n - 1, n - 1, 'WITHSCORES')
  return tonumber(found[2])
end

local reply = {allowed, now}
for i = 1, rules do
  local limit = tonumber(ARGV[2 * i])
  local period = tonumber(ARGV[2 * i + 1])
  local count = counts[i]
  local retry = -1
  if allowed == 1 then
    -- Members are unique: within one millisecond the count only grows.
    local members = {}
    for unit = 1, cost do
      members[#members + 1] = now
      members[#members + 1] = now .. '-' .. (count + unit)
    end
    redis.call('ZADD', KEYS[i], unpack(members))
    count = count + cost
    -- The expiry comes with the write: the newest admission leaves the window in one period.
    redis.call('PEXPIRE', KEYS[i], period)
  elseif count + cost > limit then
    local oldest_needed = nth_oldest(KEYS[i], count + cost - limit)
    if oldest_needed then
      retry = oldest_needed + period - now
    else
      retry = period -- costs more than the limit: it never fits
    end
  end
  local reset = 0
  local oldest = nth_oldest(KEYS[i], 1)
  if oldest then
    reset = oldest + period - now
  end
  reply[#reply + 1] = math.max(limit - count, 0)
  reply[#reply + 1] = reset
  reply[#reply + 1] = retry
end
return reply
