-- Releases a concurrency lease (Store::release) before it expires: removes its id from the leases
-- (see lua/tail.lua). Releasing a lease that expired or was released already does nothing.
--
-- KEYS[1]  the leases key (a sorted set of lease ids scored by their expiry)
-- ARGV[1]  the lease id
--
-- Returns 1 if the lease was held, else 0.
return redis.call('ZREM', KEYS[1], ARGV[1])
