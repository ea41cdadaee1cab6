-- Token bucket as GCRA (after lua/common.lua; lua/entry.lua calls it, lua/fixed_window.lua says
-- how): the arithmetic of src/store/gcra.rs, step for step, in microseconds. A counted rule's key
-- is a string holding the theoretical arrival time `tat` (µs), when the bucket is full again; it
-- expires then, since a full bucket is the same as no key. A unit drips back every `interval` =
-- ceil(period / limit) and the bucket holds `tolerance` = burst × interval; policies keep the
-- tolerance within 366 days, so every number stays below 2^53.
local token_bucket = {can_delay = true, marks = true}
-- Per rule: the bucket's tat as read (then as committed), and when the request conforms (false:
-- never, it costs more than the bucket holds).
local tb_tat, tb_conforms = {}, {}
-- The tat of each bucket the batch has read or written (0: none), by key: a hot bucket's checks
-- of one batch read it from Redis once (why that holds: logs_known, lua/common.lua). Forgotten at
-- each batch (lua/batch.lua calls forget).
local tb_known = {}
-- What Redis holds of each bucket the batch has changed, by key: a batch's charges and give-backs
-- of a bucket are written once, when it ends (token_bucket.flush), so a hot bucket's checks of one
-- batch cost Redis two commands (its read and its write) rather than a write each. Nothing reads
-- a bucket from Redis after the batch has (tb_read), so it waits safely.
local tb_stored = {}
-- The buckets read whose value is a number but not an integer's text (see NOT_AN_INTEGER).
local tb_not_integer = {}

function token_bucket.forget()
  if next(tb_known) ~= nil then
    tb_known = {}
  end
  if next(tb_stored) ~= nil then
    tb_stored = {}
  end
  if next(tb_not_integer) ~= nil then
    tb_not_integer = {}
  end
end

-- The bucket's tat (µs; 0 when it is full, the key gone), read once per batch.
local function tb_read(key)
  local tat = tb_known[key]
  if tat == nil then
    local text = call('GET', key)
    tat = tonumber(text) or 0
    tb_known[key] = tat
    if tat > 0 and not integer_text(text) then
      tb_not_integer[key] = true
    end
  end
  return tat
end

-- Notes that the bucket `key` holds `tat` now, to be written when the batch ends.
local function tb_write(key, tat)
  if tb_not_integer[key] and expire_options and tat > (tb_stored[key] or tb_known[key]) then
    error(NOT_AN_INTEGER) -- (token_bucket.flush would move it with INCRBY)
  end
  if tb_stored[key] == nil then
    tb_stored[key] = tb_known[key]
  end
  tb_known[key] = tat
end

-- (Numbers handed to redis.call go as text made with string.format: Lua's own conversion costs
-- Redis about twice as much.)
local function ceil_ms(us)
  return div(us + 999, 1000)
end

function token_bucket.prepare(shape)
  shape.intervals, shape.tolerances = {}, {}
  -- (A budget shared fairly's too, one past the last rule: lua/entry.lua.)
  for i = 1, shape.rules + (shape.fair_at > 0 and 1 or 0) do
    local limit = shape.limits[i]
    local interval = div(shape.periods[i] * 1000 + limit - 1, limit)
    shape.intervals[i] = interval
    shape.tolerances[i] = shape.bursts[i] * interval
  end
end

function token_bucket.inspect(shape, i, key, cost)
  local tat = tb_read(key)
  tb_tat[i] = tat
  -- The earliest time the request conforms: max(tat, now) + cost × interval − tolerance.
  local charge, tolerance = cost * shape.intervals[i], shape.tolerances[i]
  -- (A claim's peek of the units ahead and its own, lua/claims.lua: past the burst, when they
  -- will have gone one after another.)
  if charge > tolerance and not shape.past_burst then
    tb_conforms[i] = false
    return false
  end
  local conforms = math.max(tat, now_us) + charge - tolerance
  tb_conforms[i] = conforms
  return conforms <= now_us
end

function token_bucket.wait(_, i)
  local conforms = tb_conforms[i]
  if not conforms then
    return nil
  end
  return ceil_ms(conforms - now_us)
end

function token_bucket.commit(shape, i, key, cost, _, at_us)
  if cost == 0 then
    return -- a free request moves nothing: the bucket is as it was
  end
  local tat = math.max(tb_tat[i], at_us) + cost * shape.intervals[i]
  tb_tat[i] = tat
  tb_write(key, tat)
end

-- Writes every bucket the batch changed (see tb_stored): at its end, or before it fails as a
-- whole. A bucket moved later goes by the difference (`INCRBY`) with its expiry made later only
-- (`PEXPIREAT … GT`), which costs Redis less than a SET that replaces the value and its expiry:
-- every write leaves the key's expiry at least at its tat's ms, so it moves only when the tat
-- passes into a later ms. One given back goes whole (`SET`), or goes (`DEL`) once full.
function token_bucket.flush()
  if next(tb_stored) == nil then
    return
  end
  for key, before in pairs(tb_stored) do
    local tat = tb_known[key]
    if tat > now_us then
      local expires = ceil_ms(tat)
      if before > 0 and tat > before and expire_options then
        call('INCRBY', key, string.format('%d', tat - before))
        if expires > ceil_ms(before) then
          call('PEXPIREAT', key, text_of(expires), 'GT')
        end
      elseif tat ~= before then
        call('SET', key, string.format('%d', tat), 'PXAT', text_of(expires))
      end
    elseif before > 0 then
      call('DEL', key)
    end
  end
  tb_stored = {}
end

function token_bucket.undo()
end

-- An admission's receipt: the bucket's full time after it (now, when it is full).
function token_bucket.mark(i)
  return math.max(tb_tat[i], now_us)
end

function token_bucket.report(shape, i)
  local interval, tolerance = shape.intervals[i], shape.tolerances[i]
  local debt = math.max(tb_tat[i] - now_us, 0)
  local remaining = div(math.max(tolerance - debt, 0), interval)
  if debt == 0 then
    return remaining, 0
  end
  -- The bucket holds one more unit once tat - t <= tolerance - (remaining + 1) × interval.
  local refill = tb_tat[i] + (remaining + 1) * interval - tolerance - now_us
  return remaining, ceil_ms(math.max(refill, 0))
end

function token_bucket.give_back(shape, i, key, cost, receipt)
  local tat = tb_read(key)
  if tat > now_us then
    local interval = shape.intervals[i]
    local back
    if receipt then
      -- Only what time has not repaid of the charge, which left the bucket full at its mark:
      -- min(cost × interval, mark - now). (Its cost fit the bucket: the product is below 2^53.)
      local unrepaid = math.min(cost * interval, math.max((receipt[2 + i] or 0) - now_us, 0))
      back = math.max(tat - unrepaid, now_us)
    else
      -- (At most the debt's units, so the product stays below 2^53.)
      local units = math.min(cost, div(tat - now_us + interval - 1, interval))
      back = math.max(tat - units * interval, now_us)
    end
    tb_write(key, back > now_us and back or 0)
  end
end
