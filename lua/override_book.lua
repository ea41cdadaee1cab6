-- A policy's overrides set at run time (src/store/redis/overrides.rs): sets, removes or lists
-- them. Each identity's override lives in a key beside its counters (lua/overrides.lua reads it
-- in the check's call), and the policy's index lists them all: a hash from the identity to the
-- override key's value, and a sorted set from the identity to when it ends (ms; +inf: until
-- removed). The index lives as long as its longest override (both keys expire then), so while
-- none is set it doesn't exist, and a check finds that in one EXISTS per batch (the gate).
--
-- ARGV[1]  which keys follow: `k` (the identity's override key), `i` (the index: its ends, its
--          values) or `ki` (both: one node; a Cluster keeps them in different slots, one call
--          each)
-- ARGV[2]  `set`, `remove` or `list` (the index only)
-- ARGV[3]  the identity (set, remove)
-- ARGV[4]  the override key's value (set)
-- ARGV[5]  how long it lasts (ms; empty: until removed) (set)
--
-- Reply: nothing; a list's, {Redis's time (ms), then per override that lasts, its identity, its
-- value and the time it has left (ms; -1: until removed)}.
local which, action, identity, value, lasting = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local at = 1
if string.find(which, 'k', 1, true) then
  local key = KEYS[at]
  at = at + 1
  if action == 'set' and lasting ~= '' then
    redis.call('SET', key, value, 'PX', lasting)
  elseif action == 'set' then
    redis.call('SET', key, value)
  else
    redis.call('DEL', key)
  end
end
if not string.find(which, 'i', 1, true) then
  return nil
end
local ends, values = KEYS[at], KEYS[at + 1]
local time = redis.call('TIME')
local now = time[1] * 1000 + math.floor(time[2] / 1000)
-- The overrides that have ended leave the index.
local ended = redis.call('ZRANGEBYSCORE', ends, '-inf', now)
if #ended > 0 then
  redis.call('HDEL', values, unpack(ended))
  redis.call('ZREMRANGEBYSCORE', ends, '-inf', now)
end
if action == 'list' then
  local listed = {now}
  local all = redis.call('ZRANGE', ends, 0, -1, 'WITHSCORES')
  for i = 1, #all, 2 do
    local left = -1
    if all[i + 1] ~= 'inf' then
      left = tonumber(all[i + 1]) - now
    end
    listed[#listed + 1] = all[i]
    listed[#listed + 1] = redis.call('HGET', values, all[i]) or ''
    listed[#listed + 1] = left
  end
  return listed
end
if action == 'set' then
  redis.call('HSET', values, identity, value)
  redis.call('ZADD', ends, lasting ~= '' and (now + tonumber(lasting)) or '+inf', identity)
else
  redis.call('HDEL', values, identity)
  redis.call('ZREM', ends, identity)
end
-- The index ends with its longest override.
local last = redis.call('ZRANGE', ends, -1, -1, 'WITHSCORES')
if last[2] == 'inf' then
  redis.call('PERSIST', ends)
  redis.call('PERSIST', values)
elseif last[2] ~= nil then
  redis.call('PEXPIREAT', ends, last[2])
  redis.call('PEXPIREAT', values, last[2])
end
return nil
