-- Fixed window (after lua/common.lua; lua/entry.lua calls it). A counted rule's key is a hash
-- whose field is the window start (ms) and value the count; windows are aligned to the epoch, as
-- in the in-memory store.
--
-- Each rule is charged with one HINCRBY, which also reads the count: every redis.call costs about
-- as much as the script's own logic, so checking by reading first would double the work of the
-- common, admitted request. If any rule refuses, undo takes the charge back before the script
-- returns; the script is atomic, so nobody sees it. A counter that a window's first charge creates
-- gets its expiry in the same call, even when that charge is taken back, so no key outlives its
-- window. A fixed window can't reserve: a request that doesn't fit is refused whatever its max
-- delay.
--
-- Every algorithm's part is a table of functions made once, when the code loads, called per
-- counted rule i of the check being run (lua/entry.lua) with its shape (its limits[i],
-- periods[i] and what prepare put there), its key and its cost; what inspect reads is kept in
-- tables of the part's own, by i, until the next check:
--   prepare(shape)                              once per shape: numbers worked out per rule
--   inspect(shape, i, key, cost, peeking)       read the counter (a check may charge it
--     -> fits                                   speculatively; a peek writes nothing): whether
--                                               the rule admits the request now
--   wait(shape, i, cost) -> ms | nil            when it would (nil: never, it costs too much)
--   commit(shape, i, key, cost, at_ms, at_us)   record the request as admitted at `at`
--   undo(shape, i, key, cost, peeking)          take back a speculative charge
--   report(shape, i) -> remaining, reset (ms)
--   give_back(shape, i, key, cost, receipt)     give back `cost` units of the current window,
--     -> fits | nil                             never below zero; with a receipt (a give-back,
--                                               see lua/entry.lua), only where it says; then
--                                               whether a peek of one unit fits, its state kept
--                                               as inspect keeps it (nil: inspect must read it)
--   can_delay, marks                            whether it can reserve (a max delay), and
--                                               whether an admission's reply carries a receipt
--                                               mark per rule (mark(i))
local fixed_window = {can_delay = false, marks = false}
local fw_start, fw_count = {}, {}

function fixed_window.prepare()
end

function fixed_window.inspect(shape, i, key, cost, peeking)
  local period = shape.periods[i]
  local start = now - now % period
  local count
  if peeking then
    count = (tonumber(call('HGET', key, text_of(start))) or 0) + cost
  else
    count = call('HINCRBY', key, text_of(start), text_of(cost))
    if count == cost then
      -- A window's first charge. The key is usually new (an earlier window's has expired), but
      -- may not be: at the very edge of a window Redis may not have expired the last one's yet,
      -- and a clock may step back into an earlier window. Either way it lives to the later window
      -- end.
      window_opened(key, start, period)
    end
  end
  fw_start[i], fw_count[i] = start, count
  return count <= shape.limits[i]
end

-- inspect of a check whose charge was made already, by lua/fast.lua: `count`, the count after it.
function fixed_window.charged(shape, i, count)
  local period = shape.periods[i]
  fw_start[i], fw_count[i] = now - now % period, count
  return count <= shape.limits[i]
end

function fixed_window.wait(shape, i, cost)
  if cost > shape.limits[i] then
    return nil
  end
  return fw_start[i] + shape.periods[i] - now
end

function fixed_window.commit()
end

function fixed_window.undo(_, i, key, cost, peeking)
  if not peeking then
    -- (0 - cost, not -cost: a cost of 0 would be sent as "-0", which HINCRBY refuses.)
    call('HINCRBY', key, text_of(fw_start[i]), text_of(0 - cost))
  end
  fw_count[i] = fw_count[i] - cost
end

function fixed_window.report(shape, i)
  local count, limit = fw_count[i], shape.limits[i]
  if count == 0 then
    return limit, 0
  end
  return math.max(limit - count, 0), fw_start[i] + shape.periods[i] - now
end

function fixed_window.give_back(shape, i, key, cost, receipt)
  local period = shape.periods[i]
  local start = now - now % period
  -- A give-back's units go back only while the window they were charged in is the current one.
  if receipt and receipt[1] - receipt[1] % period ~= start then
    return nil
  end
  local count = take_back(key, text_of(start), cost)
  -- What a peek of one unit finds after it.
  fw_start[i], fw_count[i] = start, count + 1
  return count + 1 <= shape.limits[i]
end
