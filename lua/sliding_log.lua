-- Sliding-window log (after lua/common.lua; lua/entry.lua calls it, lua/fixed_window.lua says how).
-- A counted rule's key is a sorted set of admissions, one member per request whatever its cost,
-- scored by time (ms) and numbering its units (see lua/common.lua). An admission at t counts while
-- t + period > now, as in the in-memory store; a log never holds more than its rule's limit of
-- units. Reservations (a max delay) are admissions scored in the future. A request of cost 0 adds
-- nothing, but still gets the key's expiry.
local sliding_log = {can_delay = true, marks = false}
-- Per rule: the log as read (see log_read).
local sl_log = {}

function sliding_log.prepare()
end

function sliding_log.inspect(shape, i, key, cost, peeking)
  local period = shape.periods[i]
  local log
  if peeking then
    log = log_read_after(key, now - period)
  else
    log = log_current(key, period)
  end
  sl_log[i] = log
  return log.count + cost <= shape.limits[i]
end

function sliding_log.wait(shape, i, cost, key)
  local limit = shape.limits[i]
  if cost > limit then
    return nil
  end
  -- The request fits once `count + cost - limit` of the oldest units leave the window.
  local log = sl_log[i]
  return log_unit_at(key, log, log.count + cost - limit) + shape.periods[i] - now
end

function sliding_log.commit(shape, i, key, cost, at)
  log_admit(key, at, sl_log[i], cost, shape.periods[i])
end

function sliding_log.undo()
end

function sliding_log.report(shape, i)
  local log = sl_log[i]
  local reset = 0
  if log.oldest then
    reset = log.oldest + shape.periods[i] - now
  end
  return math.max(shape.limits[i] - log.count, 0), reset
end

function sliding_log.give_back(shape, i, key, cost, receipt)
  -- (Members move: the log is read anew after, once what waits of it is written.)
  log_flush(key)
  logs_known[key] = nil
  call('ZREMRANGEBYSCORE', key, '-inf', text_of(now - shape.periods[i]))
  if receipt then
    -- Back from its own member, admitted after its delay.
    log_give_back(key, cost, receipt[1] + receipt[2])
    return
  end
  local left = cost
  while left > 0 do
    local found = call('ZRANGE', key, -1, -1, 'WITHSCORES')
    if found[1] == nil then
      break
    end
    local first, units = string.match(found[1], '^%a(%d+):(%d+)$')
    first, units = tonumber(first), tonumber(units)
    if units > left then
      -- Smaller, under a name of its own; added before the old one goes, so the key (and its
      -- expiry) never lapses.
      call('ZADD', key, found[2], log_name(first, units - left))
      left = 0
    else
      left = left - units
    end
    call('ZREM', key, found[1])
  end
end
