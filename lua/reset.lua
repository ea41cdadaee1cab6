-- Resets an identity (RateLimitLayer::reset): deletes every key a check of its policy writes but
-- the quota's (counters, duplicate guard, penalty block, concurrency leases).
--
-- KEYS  the keys, as lua/head.lua lists them for the check (all share the identity's hash tag, so
--       a cluster routes the call by the first)
-- ARGV  none
--
-- Returns how many keys there were.
return redis.call('DEL', unpack(KEYS))
