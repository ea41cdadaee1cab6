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
-- The gate: on one node, a shape names the policy's index of run-time overrides (its networks'
-- hash, lua/override_book.lua), which exists only while one is set; a batch reads it once per
-- shape, and while it is absent no check of that shape reads more. On a Cluster the index lies in
-- another slot, so the shape names none: each check reads its identity's key (once per batch),
-- and no network applies. A policy keyed by client address (`n` in the shape) also matches its
-- identity, the address (or its group, `/len`), against the addresses and networks set: an
-- address first, then the first network set that holds it, when no override of the identity
-- itself is set. Under another key, or on a Cluster, the client matches the request's address
-- against its own copy of the networks (src/store/redis/override_mirror.rs), and the shape of a
-- check it found one for carries that override's value, which applies when no override of the
-- identity is set (and, on one node, while the gate says any is).
--
-- An overridden check's entry: the override key's value, then (for rules) the check's entry by
-- the override's rules; deny and unlimited have no entry after it.

-- The shapes' parser (set by lua/batch.lua).
local shape_of

-- `batch`: the batch being run, a number per batch. A shape whose policy has no override set
-- this batch (its gate read closed) holds it as `shut_in`, so its other checks of the batch cost
-- lua/batch.lua one comparison, not a call here.
local overrides = {batch = 0}

-- The batch being run, and the override keys it has read (false: none), by key: made at the
-- first read of a batch, so a batch without overrides makes no table.
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
  overrides.batch = serial
end

-- An address or a network as text (`a.b.c.d`, an IPv6 address, either with `/len`), as
-- {family (4 or 6), its units (bytes, or 16-bit groups), its prefix length}; nil for other text.
local function network_of(text)
  local address, length = string.match(text, '^([^/]+)/?(%d*)$')
  if address == nil then
    return nil
  end
  local units, family, width = {}, 4, 8
  local a, b, c, d = string.match(address, '^(%d+)%.(%d+)%.(%d+)%.(%d+)$')
  if a then
    units = {tonumber(a), tonumber(b), tonumber(c), tonumber(d)}
  else
    family, width = 6, 16
    local head, tail = address, nil
    local split = string.find(address, '::', 1, true)
    if split then
      head, tail = string.sub(address, 1, split - 1), string.sub(address, split + 2)
    end
    local function groups(part)
      local found = {}
      for group in string.gmatch(part, '[^:]+') do
        local value = tonumber(group, 16)
        if value == nil or #group > 4 then
          return nil
        end
        found[#found + 1] = value
      end
      return found
    end
    local first, last = groups(head), tail and groups(tail) or {}
    if first == nil or last == nil or #first + #last > 8 or (tail == nil and #first ~= 8) then
      return nil
    end
    for i = 1, #first do
      units[i] = first[i]
    end
    for i = #first + 1, 8 - #last do
      units[i] = 0
    end
    for i = 1, #last do
      units[8 - #last + i] = last[i]
    end
  end
  local bits = #units * width
  return {family = family, units = units, width = width,
    length = length ~= '' and tonumber(length) or bits}
end

-- Whether network `net` holds `inner` (an address, or a client's group, a network itself).
local function holds(net, inner)
  if net.family ~= inner.family or inner.length < net.length then
    return false
  end
  local left = net.length
  for i = 1, #net.units do
    if left <= 0 then
      return true
    end
    local width = net.width
    if left >= width then
      if net.units[i] ~= inner.units[i] then
        return false
      end
    else
      local unit = 2 ^ (width - left)
      return floor(net.units[i] / unit) == floor(inner.units[i] / unit)
    end
    left = left - width
  end
  return true
end

-- The networks of a gate's read (its HGETALL), parsed anew only when `#` (its changes) moved: in
-- the order they were set, each {network, its end (ms; 0: none), its value}.
local known_networks = {}
local function networks_of(gate, all)
  local changes
  for i = 1, #all, 2 do
    if all[i] == '#' then
      changes = all[i + 1]
    end
  end
  local known = known_networks[gate]
  if known and known.changes == changes then
    return known.list
  end
  local list = {}
  for i = 1, #all, 2 do
    if all[i] ~= '#' then
      local order, ends, value = string.match(all[i + 1], '^(%d+) (%d+)\n(.*)$')
      local net = network_of(all[i])
      if order and net then
        list[#list + 1] = {net = net, order = tonumber(order), ends = tonumber(ends),
          value = value}
      end
    end
  end
  -- Addresses first (an address wins over a network, as an identity does), then networks in
  -- the order they were set.
  for _, set in ipairs(list) do
    set.address = set.net.length == #set.net.units * set.net.width
  end
  table.sort(list, function(x, y)
    if x.address ~= y.address then
      return x.address
    end
    return x.order < y.order
  end)
  known_networks[gate] = {changes = changes, list = list}
  return list
end

-- What a gate holds for a shape that matches no network.
local NO_NETWORKS = {}

-- The networks set for `shape`'s policy this batch (read once per shape and batch), or nil when
-- none of its overrides is set.
local function gate_of(shape)
  if shape.gate_serial ~= serial then
    local gate = shape.override_gate
    shape.gate_serial = serial
    shape.gate_networks = nil
    -- (EXISTS first: while none is set, the common case, that is all it costs; a shape whose
    -- identity is no client address reads no network.)
    if call('EXISTS', gate) == 1 then
      shape.gate_networks = shape.by_network and networks_of(gate, call('HGETALL', gate))
        or NO_NETWORKS
    end
    if shape.gate_networks == nil then
      shape.shut_in = serial
    end
  end
  return shape.gate_networks
end

-- The override of the address, or the first network set, that holds the client address
-- `identity` names (`ip:<address>[/len]`), if one lasts (`addresses_only`: of an address only).
local function network_override(networks, identity, addresses_only)
  local inner = network_of(string.match(identity, '^ip:(.+)$') or '')
  if inner == nil then
    return nil
  end
  for _, set in ipairs(networks) do
    if addresses_only and not set.address then
      return nil
    end
    if (set.ends == 0 or set.ends > now) and holds(set.net, inner) then
      return override_of(set.value)
    end
  end
  return nil
end

-- The override of the check of `shape` whose keys follow KEYS[key_at], if one is set.
local function lookup(shape, key_at)
  local networks
  if shape.override_gate then
    networks = gate_of(shape)
    if networks == nil then
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
  if value then
    return override_of(value)
  end
  if shape.override_carried then
    return override_of(shape.override_carried)
  end
  if shape.by_network and #networks > 0 then
    -- (The identity is the hash tag: `<prefix>:{<identity>}:…`.)
    return network_override(networks, string.match(first, '{([^}]*)}') or '',
      shape.addresses_only)
  end
  return nil
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

