-- Sliding-window counter (after lua/common.lua; lua/entry.lua calls it, lua/fixed_window.lua says
-- how). A counted rule's key is a hash {s = start of the current window (ms), c = its count, p = the
-- previous window's count}; windows are aligned to the epoch, as in the in-memory store.
--
-- used = floor(previous * weight / 65536) + current, weight = floor((period - elapsed) * 65536 / period):
-- the arithmetic of src/store/weighted.rs, step for step. Every number stays an integer below 2^52
-- (limits are at most 2^35), so Lua's doubles compute it exactly and floor(a / b) is integer
-- division. A refused request writes nothing; an admitted one writes the counter, and when it opens
-- a window sets its expiry to the end of the next one, when its count stops mattering (a counter
-- charged again in the same window has it already). A sliding counter can't reserve: a request that
-- doesn't fit is refused whatever its max delay.
local sliding_counter = {can_delay = false, marks = false}
local ONE = 65536

local function weighted(previous, period, elapsed)
  return floor(previous * floor((period - elapsed) * ONE / period) / ONE)
end

-- The first elapsed time, at or after `elapsed` and within the window, at which the previous
-- window's weighted count is at most `target`; nil if only after the window ends.
local function first_at_most(previous, target, period, elapsed)
  if previous == 0 then
    return elapsed
  end
  local max_weight = floor(((target + 1) * ONE - 1) / previous)
  if max_weight >= ONE then
    return elapsed
  end
  local first = floor((ONE * period - (max_weight + 1) * period) / ONE) + 1
  if first < elapsed then
    first = elapsed
  end
  if first < period then
    return first
  end
  return nil
end

local function wait_until_fits(previous, current, cost, limit, period, elapsed)
  local room = limit - cost
  if room < 0 then
    return period -- costs more than the limit: it never fits; say one period
  end
  if room >= current then
    local first = first_at_most(previous, room - current, period, elapsed)
    if first then
      return first - elapsed
    end
  end
  -- Not in this window: in the next one, this window's count is the previous one.
  return period - elapsed + (first_at_most(current, room, period, 0) or period)
end

local function wait_until_frees(previous, current, period, elapsed)
  local faded = weighted(previous, period, elapsed)
  if faded > 0 then
    local first = first_at_most(previous, faded - 1, period, elapsed)
    if first then
      return first - elapsed
    end
    return period - elapsed -- the previous count drops out when this window ends
  end
  if current == 0 then
    return 0
  end
  return period - elapsed + (first_at_most(current, current - 1, period, 0) or period)
end
-- (end of the helpers checked by tests/it/algorithms.rs)

-- Per rule: the window's start, its count and the previous one's, and the time elapsed in it.
local sc_start, sc_current, sc_previous, sc_elapsed = {}, {}, {}, {}
-- What each counter the batch has read or written holds (its window's start, false for none; its
-- count; the previous one's), by key: a hot counter's checks of one batch read it once (why that
-- holds: logs_known, lua/common.lua). Forgotten at each batch.
local sc_known_start, sc_known_current, sc_known_previous = {}, {}, {}
-- What Redis holds of each counter the batch has charged, by key: {its window's start (false for
-- none), its count, the previous one's, its period}. A batch's charges of a counter are written
-- once, when it ends (sliding_counter.flush), so a hot counter's checks of one batch cost Redis
-- two commands (its read and its write) rather than a write each.
local sc_stored = {}
-- The counters read whose count is not an integer's text (see NOT_AN_INTEGER).
local sc_not_integer = {}

function sliding_counter.forget()
  if next(sc_known_start) ~= nil then
    sc_known_start, sc_known_current, sc_known_previous = {}, {}, {}
  end
  if next(sc_stored) ~= nil then
    sc_stored = {}
  end
  if next(sc_not_integer) ~= nil then
    sc_not_integer = {}
  end
end

-- Notes what the counter `key` holds.
local function sc_know(key, start, current, previous)
  sc_known_start[key], sc_known_current[key], sc_known_previous[key] = start, current, previous
end

-- Writes what the batch charged to the counter `key` (see sc_stored). One whose window the batch
-- opened is written whole, with its expiry the end of the next window, when its count stops
-- mattering; one charged again in the same window has that expiry already, and moves by the
-- charges (`HINCRBY`).
local function sc_flush(key)
  local stored = sc_stored[key]
  if stored == nil then
    return
  end
  sc_stored[key] = nil
  local start, current = sc_known_start[key], sc_known_current[key]
  if start ~= stored[1] then
    call('HSET', key, 's', text_of(start), 'c', text_of(current), 'p',
         text_of(sc_known_previous[key]))
    call('PEXPIREAT', key, text_of(start + 2 * stored[4]))
  elseif current ~= stored[2] then
    call('HINCRBY', key, 'c', text_of(current - stored[2]))
  end
end

-- sc_flush of every counter the batch charged: at its end, or before it fails as a whole.
function sliding_counter.flush()
  if next(sc_stored) ~= nil then
    for key in pairs(sc_stored) do
      sc_flush(key)
    end
  end
end

function sliding_counter.prepare()
end

function sliding_counter.inspect(shape, i, key, cost)
  local period = shape.periods[i]
  local window = now - now % period
  local stored_start = sc_known_start[key]
  local current, previous
  if stored_start == nil then
    local stored = call('HMGET', key, 's', 'c', 'p')
    stored_start = tonumber(stored[1]) or false
    current, previous = tonumber(stored[2]) or 0, tonumber(stored[3]) or 0
    sc_know(key, stored_start, current, previous)
    if not integer_text(stored[2]) then
      sc_not_integer[key] = true
    end
  else
    current, previous = sc_known_current[key], sc_known_previous[key]
  end
  local start = stored_start or window
  if window > start then
    -- The window just ended becomes the previous one; older ones count for nothing.
    if window - start == period then
      previous = current
    else
      previous = 0
    end
    current = 0
    start = window
  end
  -- A clock that stepped back stays in the stored window.
  local elapsed = math.max(now - start, 0)
  sc_start[i], sc_current[i], sc_previous[i], sc_elapsed[i] = start, current, previous, elapsed
  return weighted(previous, period, elapsed) + current + cost <= shape.limits[i]
end

function sliding_counter.wait(shape, i, cost)
  local limit = shape.limits[i]
  if cost > limit then
    return nil
  end
  return wait_until_fits(sc_previous[i], sc_current[i], cost, limit, shape.periods[i],
                         sc_elapsed[i])
end

function sliding_counter.commit(shape, i, key, cost)
  local stored = sc_stored[key]
  if sc_not_integer[key] and cost > 0
      and sc_start[i] == (stored and stored[1] or sc_known_start[key]) then
    error(NOT_AN_INTEGER) -- (sc_flush would move its count with HINCRBY)
  end
  local current = sc_current[i] + cost
  sc_current[i] = current
  if stored == nil then
    -- (What the batch read: nothing has changed the counter since.)
    sc_stored[key] = {sc_known_start[key], sc_known_current[key], sc_known_previous[key],
                      shape.periods[i]}
  end
  sc_know(key, sc_start[i], current, sc_previous[i])
end

function sliding_counter.undo()
end

function sliding_counter.report(shape, i)
  local period, previous, current, elapsed =
    shape.periods[i], sc_previous[i], sc_current[i], sc_elapsed[i]
  local used = weighted(previous, period, elapsed) + current
  return math.max(shape.limits[i] - used, 0),
         wait_until_frees(previous, current, period, elapsed)
end

function sliding_counter.give_back(shape, i, key, cost, receipt)
  local period = shape.periods[i]
  -- (What the batch charged it first: the give-back reads and writes Redis itself.)
  sc_flush(key)
  local stored = call('HMGET', key, 's', 'c', 'p')
  local start = tonumber(stored[1])
  local field
  if not receipt then
    if start == now - now % period then
      field = 'c'
    end
  else
    -- The charged window's count: the stored window's (current, or previous once time moved
    -- on), or the one before it, which still weighs in the estimate until the stored one ends.
    local charged = receipt[1] - receipt[1] % period
    if charged == start then
      field = 'c'
    elseif start and charged + period == start then
      field = 'p'
    end
  end
  if field then
    local count = tonumber(stored[field == 'c' and 2 or 3]) or 0
    if count > 0 then
      local left = math.max(count - cost, 0)
      call('HSET', key, field, text_of(left))
      if field == 'c' then
        sc_know(key, start, left, tonumber(stored[3]) or 0)
      else
        sc_know(key, start, tonumber(stored[2]) or 0, left)
      end
    end
  end
end
