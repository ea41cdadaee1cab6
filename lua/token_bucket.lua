-- Token bucket as GCRA (between lua/head.lua and lua/tail.lua): the arithmetic of
-- src/store/gcra.rs, step for step, in microseconds. A counted rule's key is a string holding the
-- theoretical arrival time `tat` (µs), when the bucket is full again; it expires then, since a full
-- bucket is the same as no key. A unit drips back every `interval` = ceil(period / limit) and the
-- bucket holds `tolerance` = burst × interval; policies keep the tolerance within 366 days, so
-- every number stays below 2^53.
rule_arity = 3 -- limit, period and burst

local function inspect(i, limit, period, burst)
  local key = KEYS[i]
  local interval = div(period * 1000 + limit - 1, limit)
  local tolerance = burst * interval
  local tat = tonumber(call('GET', key)) or 0
  local state = {key = key, interval = interval, tolerance = tolerance, tat = tat, burst = burst}
  -- The earliest time the request conforms: max(tat, now) + cost × interval − tolerance.
  local charge = cost * interval
  if charge <= tolerance then
    state.conforms_at = math.max(tat, now_us) + charge - tolerance
    state.fits = state.conforms_at <= now_us
  else
    state.fits = false
  end
  return state
end

local function ceil_ms(us)
  return div(us + 999, 1000)
end

local function wait(state)
  if state.conforms_at == nil then
    return nil
  end
  return ceil_ms(state.conforms_at - now_us)
end

local function commit(state, _, at_us)
  if cost == 0 then
    return -- a free request moves nothing: the bucket is as it was
  end
  state.tat = math.max(state.tat, at_us) + cost * state.interval
  call('SET', state.key, string.format('%d', state.tat), 'PXAT', ceil_ms(state.tat))
end

local function give_back(i, limit, period)
  local key = KEYS[i]
  local tat = tonumber(call('GET', key))
  if tat and tat > now_us then
    local interval = div(period * 1000 + limit - 1, limit)
    local back
    if giving_back then
      -- Only what time has not repaid of the charge, which left the bucket full at its mark:
      -- min(cost × interval, mark - now). (Its cost fit the bucket: the product is below 2^53.)
      local unrepaid = math.min(cost * interval, math.max((receipt[2 + i] or 0) - now_us, 0))
      back = math.max(tat - unrepaid, now_us)
    else
      -- (At most the debt's units, so the product stays below 2^53.)
      local units = math.min(cost, div(tat - now_us + interval - 1, interval))
      back = math.max(tat - units * interval, now_us)
    end
    if back > now_us then
      call('SET', key, string.format('%d', back), 'PXAT', ceil_ms(back))
    else
      call('DEL', key)
    end
  end
end

local function undo()
end

-- An admission's receipt: the bucket's full time after it (now, when it is full; lua/tail.lua).
marks_tat = true

local function report(state)
  local debt = math.max(state.tat - now_us, 0)
  local remaining = div(math.max(state.tolerance - debt, 0), state.interval)
  if debt == 0 then
    return remaining, 0
  end
  -- The bucket holds one more unit once tat - t <= tolerance - (remaining + 1) × interval.
  local refill = state.tat + (remaining + 1) * state.interval - state.tolerance - now_us
  return remaining, ceil_ms(math.max(refill, 0))
end
