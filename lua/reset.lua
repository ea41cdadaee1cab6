-- Resets an identity (RateLimitLayer::reset): deletes every key a check of its policy writes but
-- the quota's (counters, duplicate guard, penalty block, concurrency leases), marks when, and
-- tells every instance sharing the store (src/store/redis/resets.rs), so units one holds ahead
-- of the key go too. The marker lives as long as a receipt of an earlier admission can still
-- give something back (reset_marker_ms in src/store/mod.rs): a give-back of an admission
-- checked before it gives its rules nothing (lua/entry.lua), their counts since hold none of its
-- units.
--
-- KEYS     the keys, as lua/entry.lua lists them for the check (all share the identity's hash tag,
--          so a cluster routes the call by the first), then the reset marker
-- ARGV[1]  the key reset, as the check names it (what the notice says)
-- ARGV[2]  how long the marker lives (ms)
-- ARGV[3]  empty (the time is Redis TIME), or a time in µs that tests fix
--
-- Returns how many keys there were.
local marker = KEYS[#KEYS]
local deleted = redis.call('DEL', unpack(KEYS, 1, #KEYS - 1))
local now_us
if ARGV[3] == '' then
  local time = redis.call('TIME')
  now_us = time[1] * 1000000 + time[2]
else
  now_us = tonumber(ARGV[3])
end
local now = math.floor(now_us / 1000)
redis.call('SET', marker, string.format('%d', now), 'PX', math.max(tonumber(ARGV[2]), 1))
-- (pcall: an ACL user without this channel still resets; the instances that can't hear it drop
-- their units at the end of their window, as without notices.)
redis.pcall('PUBLISH', 'tower-redis-ratelimit:resets', ARGV[1])
return deleted
