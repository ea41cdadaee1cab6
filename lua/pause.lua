-- Pauses a key (Store::pause, an outbound upstream's "stop for a while"): sets its block key to
-- the pause's end in Redis's time, expiring then, unless it already ends later.
--
-- KEYS[1]  the block key (the one lua/entry.lua writes a penalty block to)
-- ARGV[1]  the pause (ms)
--
-- Returns 1.
local time = redis.call('TIME')
local ends = time[1] * 1000 + math.floor(time[2] / 1000) + tonumber(ARGV[1])
if ends > (tonumber(redis.call('GET', KEYS[1])) or 0) then
  redis.call('SET', KEYS[1], string.format('%d', ends), 'PXAT', string.format('%d', ends))
end
return 1
