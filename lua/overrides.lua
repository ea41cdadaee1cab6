-- Overrides set at run time (RateLimiter::set_override; after lua/claims.lua, before
-- lua/batch.lua). An identity's override is kept in a key of its own beside its counters,
-- `<stem>:override`, where the stem is what its counters' keys share
-- (`<prefix>:{<identity>}:<policy>`, so on a Cluster it lies in their slot). A check or a peek
-- whose shape says so (`~<suffix>~<gate>`, see lua/batch.lua) reads it in its own call and, when
-- one is set, is checked by the override's rules instead of the policy's: no round trip more,
-- and once an operator has set one, every instance's next check of the identity applies it.
--
-- An override key holds `<what>\n<the override as the crate reads it back>`, where <what> is
-- `d` (deny: refused, nothing counted), `u` (unlimited: admitted, nothing counted) or
-- `r|<code>|<rules>|<flags>|<limit>|<period>[|<burst>]…|<counter>…`: the override's counted
-- rules as a shape lists them (see lua/batch.lua), a metering flag each (`m` or `r`), and each
-- rule's counter, its key after the stem (the policy's rule of the same period and metering when
-- it has one, so that what the identity has used carries over).
--
-- The gate: on one node, a shape names the policy's index of run-time overrides, which exists
-- only while one is set (src/store/redis/overrides.rs keeps it); a batch reads it once per
-- shape, and while it is absent no check of that shape reads more. On a Cluster the index lies in
-- another slot, so the shape names none: each check reads its identity's key (once per batch).
--
-- An overridden check's entry: the override key's value, then (for rules) the check's entry by
-- the override's rules; deny and unlimited have no entry after it.

-- The shapes' parser (set by lua/batch.lua).
local shape_of

local overrides = {}

-- The batch being run (a number per batch), and the override keys it has read (false: none), by
-- key: made at the first read of a batch, so a batch without overrides makes no table.
local serial, seen_serial, seen = 0, -1, nil

-- An override key's value, parsed once (remembered).
local override_of = remembered(function(value)
  local line_end = string.find(value, '\n', 1, true)
  local what = line_end and string.sub(value, 1, line_end - 1) or value
  if what == 'd' or what == 'u' then
    return {action = what, value = value}
  end
  local pieces = {}
  for text in string.gmatch(what .. '|', '([^|]*)|') do
    pieces[#pieces + 1] = text
  end
  local code, rules, flags = pieces[2], tonumber(pieces[3]), pieces[4]
  local arity = code == 'tb' and 3 or 2
  if pieces[1] ~= 'r' or rules == nil or rules < 1 or flags == nil or #flags ~= rules
      or #pieces ~= 4 + (arity + 1) * rules then
    error('malformed run-time override ' .. what)
  end
  local counters = {}
  for i = 1, rules do
    counters[i] = ':' .. pieces[4 + arity * rules + i]
  end
  return {
    action = 'r', value = value, code = code, rules = rules, flags = flags,
    params = table.concat(pieces, '|', 5, 4 + arity * rules), counters = counters,
    -- Its shape for each shape of the policy's (by the policy's shape).
    shapes = {},
  }
end)

-- Starts a batch.
function overrides.begin()
  serial = serial + 1
end

-- The override of the check of `shape` whose keys follow KEYS[key_at], if one is set.
local function lookup(shape, key_at)
  local gate = shape.override_gate
  if gate then
    if shape.gate_serial ~= serial then
      shape.gate_serial, shape.gate_open = serial, call('EXISTS', gate) == 1
    end
    if not shape.gate_open then
      return nil
    end
  end
  local first = batch_keys[key_at + 1]
  local key = string.sub(first, 1, #first - shape.override_suffix) .. ':override'
  if seen_serial ~= serial then
    seen, seen_serial = {}, serial
  end
  local value = seen[key]
  if value == nil then
    -- (pcall: while a Cluster moves the identity's slot, a key that has left this node can't be
    -- read here, and the check goes on by the policy's rules rather than failing.)
    value = redis.pcall('GET', key)
    if type(value) == 'table' then
      value = false
    end
    seen[key] = value
  end
  if not value then
    return nil
  end
  return override_of(value)
end

-- The shape of `over`'s rules in place of the counted rules of `shape` (its cost, options and
-- other keys as they are).
local function shape_by(over, shape)
  local own = over.shapes[shape]
  if own then
    return own
  end
  local cost = shape.cost_text
  local request, units, flags = string.match(cost, '^(%d+):(%d+):([mr]+)$')
  if request then
    -- A metered request's flags: the override's rules', then the quota's.
    cost = request .. ':' .. units .. ':' .. over.flags .. string.sub(flags, shape.rules + 1)
  end
  own = shape_of(table.concat({over.code, over.rules + shape.keys - shape.rules, cost,
    shape.options_text, over.params}, '|'))
  over.shapes[shape] = own
  return own
end

-- Runs the check of `shape` whose keys follow KEYS[key_at] by its identity's run-time override,
-- writing its entry after out[n]; returns the index of its last item, or nil when no override is
-- set (nothing written).
function overrides.run(shape, key_at, receipt, n)
  local over = lookup(shape, key_at)
  if over == nil then
    return nil
  end
  if over.action ~= 'r' then
    out[n + 1] = over.value
    return n + 1
  end
  local own = shape_by(over, shape)
  local first = batch_keys[key_at + 1]
  local stem = string.sub(first, 1, #first - shape.override_suffix)
  local keys = {}
  for i = 1, over.rules do
    keys[i] = stem .. over.counters[i]
  end
  for j = 1, shape.keys - shape.rules do
    keys[over.rules + j] = batch_keys[key_at + shape.rules + j]
  end
  -- The check runs on these keys (lua/batch.lua puts the batch's back, even after an error).
  local keys_of_batch = batch_keys
  batch_keys = keys
  local m = own.lean and own.lean(keys, 0, own, now, out, n + 1, receipt)
  if not m then
    m = run_entry(own, 0, receipt, n + 1)
  end
  batch_keys = keys_of_batch
  -- (Written last: a check that fails leaves `out` as it was.)
  out[n + 1] = over.value
  return m
end

