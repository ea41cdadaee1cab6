-- Fixed window (between lua/head.lua and lua/tail.lua). A counted rule's key is a hash whose field
-- is the window start (ms) and value the count; windows are aligned to the epoch, as in the
-- in-memory store.
--
-- Each rule is charged with one HINCRBY, which also reads the count: every redis.call costs about as
-- much as the script's own logic, so checking by reading first would double the work of the common,
-- admitted request. If any rule refuses, undo takes the charge back before the script returns; the
-- script is atomic, so nobody sees it. A counter that a window's first charge creates gets its
-- expiry in the same call, even when that charge is taken back, so no key outlives its window.
-- A fixed window can't reserve: a request that doesn't fit is refused whatever its max delay.
max_delay = -1

local function inspect(i, limit, period)
  local key = KEYS[i]
  local start = now - now % period
  local count
  if peek then
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
  return {key = key, limit = limit, start = start, ends = start + period, count = count,
          fits = count <= limit}
end

local function wait(state)
  if cost > state.limit then
    return nil
  end
  return state.ends - now
end

local function commit()
end

local function give_back(i, _, period)
  local key = KEYS[i]
  -- A give-back's units go back only while the window they were charged in is the current one.
  if giving_back and charged_at - charged_at % period ~= now - now % period then
    return
  end
  local start = text_of(now - now % period)
  local count = tonumber(call('HGET', key, start)) or 0
  if count > 0 then
    call('HINCRBY', key, start, text_of(0 - math.min(cost, count)))
  end
end

local function undo(state)
  if not peek then
    -- (0 - cost, not -cost: a cost of 0 would be sent as "-0", which HINCRBY refuses.)
    call('HINCRBY', state.key, text_of(state.start), text_of(0 - cost))
  end
  state.count = state.count - cost
end

local function report(state)
  if state.count == 0 then
    return state.limit, 0
  end
  return math.max(state.limit - state.count, 0), state.ends - now
end
