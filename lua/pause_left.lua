-- How long a key's pause has left (Store::pause_left): read by an outbound call that waited for
-- its reserved slot, just before it is sent, to see a pause set meanwhile by any instance.
--
-- KEYS[1]  the block key: a string holding the end (ms) of a pause or penalty block, expiring
--          then (lua/entry.lua and Store::pause set it so)
-- ARGV     none
--
-- Returns the ms left, by Redis's clock like the end itself (PTTL); 0 or less when not paused
-- (-2: no such key).
return redis.call('PTTL', KEYS[1])
