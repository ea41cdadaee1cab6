-- A policy's overrides set at run time (src/store/redis/overrides.rs): sets, removes or lists
-- them. An identity's override lives in a key beside its counters (lua/overrides.lua reads it in
-- the check's call); a network's (an address is a network of one) in the policy's index, which a
-- check of a policy keyed by client address reads once per batch. The index: a sorted set from
-- each target to when it ends (ms; +inf: until removed; `net:<network>` for a network), a hash
-- from each identity to its override key's value, and a hash from each network to `<order>
-- <end ms, 0: none>\n<value>`, whose field `#` counts the changes (the gate: it exists while any
-- override is set). The index lives as long as its longest override (its keys expire then), so
-- while none is set it doesn't exist, and a check finds that in one read per batch.
--
-- ARGV[1]  which keys follow: `k` (the identity's override key), `i` (the index: its ends, its
--          identities' values, its networks) or `ki` (both: one node; a Cluster keeps them in
--          different slots, one call each)
-- ARGV[2]  `set`, `remove`, `list` or `networks` (the index only; `networks`: the list of the
--          networks and addresses only, which an instance keeps a copy of when its checks can't
--          match them in their own call, src/store/redis/override_mirror.rs)
-- ARGV[3]  the identity, or `net:<network>` for a network (set, remove)
-- ARGV[4]  the override's value (set; see lua/overrides.lua)
-- ARGV[5]  how long it lasts (ms; empty: until removed) (set)
-- ARGV[6]  an identity's key as a check names it (set, remove, with `k`): every instance hears
--          it, as a reset's (src/store/redis/resets.rs), and drops the units it took ahead of it
--          under the rules before
--
-- Reply: nothing; a list's, {Redis's time (ms), then per override that lasts, its target (an
-- identity, or `net:<network>`), its value (a network's as its hash holds it, its order first)
-- and the time it has left (ms; -1: until removed)}.
--
-- A change of a network is published on the same channel as the index's first key, the notice
-- on which the instances keeping a copy of the networks read them anew.
local which, action, target, value, lasting = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local network = string.match(target, '^net:(.+)$')
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
  -- (pcall: an ACL user without this channel still changes it; an instance that can't hear it
  -- spends its units in hand first, as after a reset.)
  redis.pcall('PUBLISH', 'tower-redis-ratelimit:resets', ARGV[6])
end
if not string.find(which, 'i', 1, true) then
  return nil
end
local ends, values, networks = KEYS[at], KEYS[at + 1], KEYS[at + 2]
local time = redis.call('TIME')
local now = time[1] * 1000 + math.floor(time[2] / 1000)

if action == 'networks' then
  -- (Read only: those that have ended are left out, and swept by the next change.)
  local listed = {now}
  local all = redis.call('HGETALL', networks)
  for i = 1, #all, 2 do
    local ending = all[i] ~= '#' and string.match(all[i + 1], '^%d+ (%d+)\n')
    if ending and (ending == '0' or tonumber(ending) > now) then
      listed[#listed + 1] = 'net:' .. all[i]
      listed[#listed + 1] = all[i + 1]
      listed[#listed + 1] = ending == '0' and -1 or tonumber(ending) - now
    end
  end
  return listed
end

-- Takes `member` (a target as the sorted set names it) out of the index.
local function drop(member)
  local ended_network = string.match(member, '^net:(.+)$')
  if ended_network then
    redis.call('HDEL', networks, ended_network)
  else
    redis.call('HDEL', values, member)
  end
  redis.call('ZREM', ends, member)
end

-- The overrides that have ended leave the index.
for _, member in ipairs(redis.call('ZRANGEBYSCORE', ends, '-inf', now)) do
  drop(member)
end
if action == 'list' then
  local listed = {now}
  local all = redis.call('ZRANGE', ends, 0, -1, 'WITHSCORES')
  for i = 1, #all, 2 do
    local left = -1
    if all[i + 1] ~= 'inf' then
      left = tonumber(all[i + 1]) - now
    end
    local kept
    local listed_network = string.match(all[i], '^net:(.+)$')
    if listed_network then
      kept = redis.call('HGET', networks, listed_network)
    else
      kept = redis.call('HGET', values, all[i])
    end
    listed[#listed + 1] = all[i]
    listed[#listed + 1] = kept or ''
    listed[#listed + 1] = left
  end
  return listed
end
drop(target)
if action == 'set' then
  local ending = lasting ~= '' and now + tonumber(lasting) or nil
  redis.call('ZADD', ends, ending or '+inf', target)
  if network then
    -- In the order set (the first that holds an address applies), and when it ends.
    local order = redis.call('HINCRBY', networks, '#', 1)
    redis.call('HSET', networks, network,
      string.format('%d %d\n', order, ending or 0) .. value)
  else
    redis.call('HSET', values, target, value)
  end
end
-- Every change is counted: a batch that read the networks before reads them anew.
redis.call('HINCRBY', networks, '#', 1)
if network then
  redis.pcall('PUBLISH', 'tower-redis-ratelimit:resets', ends)
end
-- The index ends with its longest override.
local last = redis.call('ZRANGE', ends, -1, -1, 'WITHSCORES')
if last[2] == nil then
  redis.call('DEL', ends, values, networks)
elseif last[2] == 'inf' then
  redis.call('PERSIST', ends)
  redis.call('PERSIST', values)
  redis.call('PERSIST', networks)
else
  redis.call('PEXPIREAT', ends, last[2])
  redis.call('PEXPIREAT', values, last[2])
  redis.call('PEXPIREAT', networks, last[2])
end
return nil
