-- The end of the rate-limit script: checks a batch of requests, one after another in the order
-- given, each as if it were a script call of its own (group commit: Redis's fixed cost of a script
-- call and of TIME is paid once per batch). Before this part the store puts lua/common.lua, each
-- algorithm's part (fw: lua/fixed_window.lua, sl: lua/sliding_log.lua, sc:
-- lua/sliding_counter.lua, tb: lua/token_bucket.lua), lua/leases.lua (a concurrency limit's
-- leases), lua/fair.lua (a budget's fair shares), lua/entry.lua (one check, its steps chosen by its shape), lua/fast.lua (the common checks, inline: lean functions that leave the rest
-- to lua/entry.lua), lua/claims.lua (metered calls waiting their turn) and lua/overrides.lua
-- (an identity's override set at run time).
--
-- All of it is the function `batch(KEYS, ARGV)`: the store registers it as a Redis function
-- (FUNCTION LOAD once, then FCALL: the helpers, the algorithms' parts and the shapes parsed are
-- made once, not at every call) or, on a Redis before 7.0 or a cluster, runs it as a script
-- (EVALSHA) whose last line calls it.
--
-- KEYS           every request's keys, request after request (as lua/entry.lua lists them)
-- ARGV[1]        empty (the time is Redis TIME), or a time in µs that tests fix
-- ARGV[2]        how many shapes follow
-- then the shapes: what the requests of one policy and cost share, sent once per batch rather
--                than per request (every argument costs Redis about as much as a command in the
--                script), as one piece, `<algorithm's code>|<key count>|<cost>|<options>|<limit>|
--                <period>[|<burst>]…`: the cost, `<cost>` or, when a rule or the quota counts
--                metered units, `<cost>:<units>:<flags>` (see costs_of, lua/common.lua); the
--                options, comma-separated, or empty when there are none (the common case): max
--                delay (ms; 0: refuse what doesn't fit now), duplicate guard window (ms; 0: none),
--                penalty block (ms; 0: none), quota limit (0: no quota), quota day length (ms),
--                where quota days start after epoch-aligned ones (ms), most requests in flight at
--                once (0: no concurrency limit), a lease's length (ms), what this is (0: a check,
--                1: a peek, 2: a refund, 3: a give-back, 4: an overdraw; plus 8: decided by
--                lua/entry.lua alone, the tests' generic form), a budget shared fairly's limit
--                (0: none), period (ms) and burst, the request's cost in it, its identity's
--                weight and whether it counts metered units (1, else 0; lua/fair.lua), then per
--                alert
--                threshold its percent and the count that reaches it; then per counted rule its
--                limit, period (ms) and, for a token bucket, its burst. A lease's release has the
--                shape `rl|1`: its one key is the leases. A check's or a peek's shape may end
--                `~<suffix>[n|a][c<length>]~<gate>[<value>]`: its identity's run-time override
--                applies (lua/overrides.lua), or else <value>, the last <length> bytes, an
--                override the client carries.
-- then per request, in order: the number of its shape (1-based); a give-back's is followed by
--                `@` and its receipt, what its admission's check answered: `<time it was checked
--                (ms)>,<its delay (ms)>` and, for a token bucket, `,<the bucket's full time after
--                it (µs)>` per counted rule; a release's by `@` and the lease's id, or several
--                apart by spaces (a batch's releases of one key's leases,
--                src/store/redis/merge.rs); a check with a claim (lua/claims.lua) by
--                `#<claim id>,<lasting ms>`, its claims key after its shape's keys
--
-- Reply: one flat array (a nested one costs Redis and the client a table and an array per
-- request; every item costs Redis about as much as an argument), packed as one MessagePack string
-- (`cmsgpack.pack`: it costs Redis what the array as a reply would, and the client reads one
-- string rather than a reply item per number): the batch's time (ms), then per request, in order,
-- its entry, which is
--   - an admission's short form: remaining and reset per rule (the counted rules, the guard, the
--     quota, the concurrency limit), two items per rule and nothing before them, then the lease
--     taken (with a concurrency limit) and each token bucket's full time (its receipt mark),
--     since the client knows the request's rules: the request was admitted without delay, no
--     rule has a retry, and it has no alert to say;
--   - or the check's reply (see lua/entry.lua), which is longer, after its length negated (never
--     -1: a reply has at least 2 items), which no short form starts with (a remaining count); a
--     release's is {1 if any of its leases was held else 0, 0};
--   - or -1 and the error of a request whose check failed (a key of the wrong type): the others
--     still count.

-- The algorithms' parts, by code.
local algorithms = {fw = fixed_window, sl = sliding_log, sc = sliding_counter, tb = token_bucket}

-- Each option's name, in the order of the options piece (see lua/entry.lua).
local OPTIONS = {'max_delay', 'guard_window', 'block', 'quota_limit', 'quota_day', 'quota_offset',
                 'max_in_flight', 'lease', 'kind', 'fair_limit', 'fair_period', 'fair_burst',
                 'fair_cost', 'fair_weight', 'fair_metered'}

-- A shape, parsed from its piece once (remembered, see lua/common.lua): everything lua/entry.lua
-- reads of it, worked out here rather than per check. A release's shape is `rl|1`: its one key,
-- the leases. A check's or a peek's may end `~<suffix>[n|a][c<length>]~<gate>[<value>]`: its
-- identity's run-time override applies (lua/overrides.lua), its key found by the first key's
-- last <suffix> characters; <gate>, when not empty, is the policy's index of them (its networks'
-- hash; a policy's name or prefix may hold `~`, so nothing after it is found by a separator);
-- `n` says the identity is a client address, which addresses and networks set at run time may
-- hold, `a` the same for addresses only; <value>, the last <length> bytes, an override's value,
-- applies when the identity has none (the client found it: a network holding the client's
-- address, under a policy keyed by something else, or on a Cluster).
shape_of = remembered(function(whole)
  local piece, suffix, by_network, carried_length, gate =
    string.match(whole, '^([^~]*)~(%d+)([na]?)c?(%d*)~(.*)$')
  local carried = ''
  if carried_length and carried_length ~= '' then
    local cut = #gate - tonumber(carried_length)
    gate, carried = string.sub(gate, 1, cut), string.sub(gate, cut + 1)
  end
  piece = piece or whole
  local pieces = {}
  for text in string.gmatch(piece .. '|', '([^|]*)|') do
    pieces[#pieces + 1] = text
  end
  local code, keys = pieces[1], tonumber(pieces[2])
  if code == 'rl' and keys == 1 then
    return {release = true, keys = 1}
  end
  local algorithm = algorithms[code]
  if algorithm == nil or keys == nil or #pieces < 4 then
    error('malformed shape ' .. piece)
  end
  local shape = {code = code, keys = keys, algorithm = algorithm}
  local options = {}
  for number in string.gmatch(pieces[4], '%d+') do
    options[#options + 1] = tonumber(number)
  end
  for i, name in ipairs(OPTIONS) do
    shape[name] = options[i] or 0
  end
  if not algorithm.can_delay then
    shape.max_delay = -1
  end
  -- A kind plus 8: decided by lua/entry.lua alone, never a lean function (the crate's tests
  -- compare the two).
  local entry_only = shape.kind >= 8
  if entry_only then
    shape.kind = shape.kind - 8
  end
  shape.thresholds = math.max(floor((#options - #OPTIONS) / 2), 0)
  shape.percents, shape.useds, shape.alert_fields = {}, {}, {}
  for j = 1, shape.thresholds do
    shape.percents[j] = options[#OPTIONS + 2 * j - 1]
    shape.useds[j] = options[#OPTIONS + 2 * j]
    shape.alert_fields[j] = 'a' .. string.format('%d', options[#OPTIONS + 2 * j - 1])
  end
  -- The keys after the counted rules', in lua/entry.lua's order.
  local extra = 0
  local function next_key(present)
    if not present then
      return 0
    end
    extra = extra + 1
    return extra
  end
  local guard = next_key(shape.guard_window > 0)
  local quota = next_key(shape.quota_limit > 0)
  local in_flight = next_key(shape.max_in_flight > 0)
  local block = next_key(shape.block > 0)
  local marker = next_key(shape.kind == 3)
  local fair = shape.fair_limit > 0
  local budget, shares, tenant = next_key(fair), next_key(fair), next_key(fair)
  local rules = keys - extra
  local arity = code == 'tb' and 3 or 2
  if rules < 0 or #pieces ~= 4 + arity * rules then
    error('malformed shape ' .. piece)
  end
  shape.rules = rules
  if suffix and rules > 0 then
    shape.override_suffix = tonumber(suffix)
    shape.override_gate = gate ~= '' and gate or nil
    shape.by_network = by_network ~= '' and shape.override_gate ~= nil
    shape.addresses_only = by_network == 'a'
    shape.override_carried = carried ~= '' and carried or nil
  end
  shape.cost_text, shape.options_text = pieces[3], pieces[4]
  local function at(offset)
    return offset > 0 and rules + offset or 0
  end
  shape.guard_at, shape.quota_at = at(guard), at(quota)
  shape.in_flight_at, shape.block_at, shape.marker_at = at(in_flight), at(block), at(marker)
  shape.budget_at, shape.shares_at, shape.tenant_at = at(budget), at(shares), at(tenant)
  local costs = costs_of(pieces[3])
  shape.costs, shape.limits, shape.periods, shape.bursts = {}, {}, {}, {}
  for i = 1, rules do
    local base = 4 + arity * (i - 1)
    shape.costs[i] = costs[i]
    shape.limits[i], shape.periods[i] = tonumber(pieces[base + 1]), tonumber(pieces[base + 2])
    shape.bursts[i] = arity == 3 and tonumber(pieces[base + 3]) or shape.limits[i]
  end
  shape.quota_cost = costs[rules + 1]
  -- A budget shared fairly: its numbers one past the last counted rule's (lua/entry.lua).
  shape.fair_at = 0
  if fair then
    local budget_at = rules + 1
    shape.fair_at = budget_at
    shape.limits[budget_at] = shape.fair_limit
    shape.periods[budget_at] = math.max(shape.fair_period, 1)
    shape.bursts[budget_at] = shape.fair_burst > 0 and shape.fair_burst or shape.fair_limit
    shape.fair_weight = math.max(shape.fair_weight, 1)
  end
  -- The cost piece whole (its request cost, units and flags: lua/claims.lua).
  shape.cost_piece = costs
  -- A unit in every rule and the quota: what a refund's or an overdraw's answer peeks.
  shape.ones = costs_of('1')
  algorithm.prepare(shape)
  -- The check's lean function (lua/fast.lua), tried before lua/entry.lua: without options, the
  -- algorithm's own where it has one; a fixed window's give-back with no other option; a
  -- fixed window with a quota, a block or a lease; another algorithm with a quota, a block or a
  -- max delay (fast.admit).
  shape.options = pieces[4] ~= ''
  if entry_only or fair then
    shape.lean = nil
  elseif fast[code] and not shape.options then
    shape.lean = fast[code]
  elseif shape.kind == KIND_GIVE_BACK and code == 'fw' and shape.quota_limit == 0
      and shape.guard_window == 0 and shape.block == 0 and shape.max_in_flight == 0 then
    shape.lean = fast.fw_give_back
  elseif shape.kind == KIND_CHECK and shape.guard_window == 0 then
    if code == 'fw' then
      shape.lean = fast.fw
    elseif shape.max_in_flight == 0 then
      shape.lean = fast.admit
    end
  end
  return shape
end)

-- The batch being run, set by batch() (a library's calls run one at a time): its arguments, its
-- time (ms, µs), the reply so far (`out`, up to item n; a table kept from call to call, its items
-- past n cleared before it is packed; `kept`, the last call's n), the next check's first key
-- (after key_at) and shape number (ARGV[at]), the shape of the check being run (nil while it is
-- read) and how many keys it has.
local batch_args
local n, kept = 0, 0
local key_at, at, shape, entry_keys
out = {}

-- A give-back's entry (see above), parsed once (remembered): {its shape's number, its receipt's
-- numbers}, or nil for an entry that is not a give-back's. The checks of a batch share its time, so
-- the give-backs of their requests mostly carry the same text, and parsing it anew cost Redis
-- about as much as the give-back's own work. (A receipt is only read, never changed.)
local give_back_entry = remembered(function(entry)
  -- (A release's or a claim's entry has no comma before its end; finding none is cheaper than
  -- the pattern failing.)
  if not string.find(entry, ',', 1, true) or string.find(entry, '#', 1, true) then
    return nil
  end
  local number, checked, delay, marks = string.match(entry, '^(%d+)@(%d+),(%d+)([%d,]*)$')
  if number == nil then
    return nil
  end
  local receipt = {tonumber(checked), tonumber(delay)}
  if marks ~= '' then
    for value in string.gmatch(marks, '%d+') do
      receipt[#receipt + 1] = tonumber(value)
    end
  end
  return {tonumber(number), receipt}
end)

-- A request's entry with a receipt (see above): its shape's number, and the receipt: its
-- numbers (a give-back's), its text (a release's lease ids), or a claim's
-- {claim = id (text), lasting = ms} (lua/claims.lua).
local function with_receipt(entry)
  local give_back = give_back_entry(entry)
  if give_back then
    return give_back[1], give_back[2]
  end
  -- A release's: its ids are checked where they are read (leases_release, lua/leases.lua), since
  -- a pattern over a batch's joined ids cost Redis more than their release.
  local at = string.find(entry, '@', 1, true)
  if at ~= nil and at > 1 and not string.find(entry, '#', 1, true) then
    local number = string.match(string.sub(entry, 1, at - 1), '^%d+$')
    local leases = string.sub(entry, at + 1)
    if number and string.find(leases, '^%d') then
      return tonumber(number), leases
    end
  end
  local number, id, lasting = string.match(entry, '^(%d+)#(%d+),(%d+)$')
  if number == nil then
    return nil
  end
  return tonumber(number), {claim = id, lasting = tonumber(lasting)}
end

-- Runs the checks from the one at key_at and at on, writing their entries after out[n].
local function run_checks()
  local last = #batch_args
  while at <= last do
    shape = nil
    local entry = batch_args[at]
    local number, receipt = number_of(entry), nil
    if number == nil then
      number, receipt = with_receipt(entry)
    end
    shape = shape_of(batch_args[2 + number])
    local claimed = type(receipt) == 'table' and receipt.claim ~= nil
    -- (A claim's key follows its shape's keys.)
    entry_keys = claimed and shape.keys + 1 or shape.keys
    local overridden = shape.override_suffix and shape.shut_in ~= overrides.batch
      and not claimed and overrides.run(shape, key_at, receipt, n)
    local lean = not overridden and not claimed and shape.lean
      and shape.lean(batch_keys, key_at, shape, now, out, n, receipt)
    if overridden then
      n = overridden
    elseif claimed then
      n = run_claimed(shape, key_at, receipt, n)
    elseif lean then
      n = lean
    elseif shape.release then
      -- A release: 1 if any of its leases was held, else 0 (releasing one that expired or was
      -- released already does nothing).
      local held = math.min(leases_release(batch_keys[key_at + 1], receipt), 1)
      out[n + 1], out[n + 2], out[n + 3] = -2, held, 0
      n = n + 3
    else
      n = run_entry(shape, key_at, receipt, n)
    end
    key_at = key_at + entry_keys
    at = at + 1
  end
end

-- Writes what the batch's checks counted and Redis doesn't hold yet: the logs' admissions
-- (log_flush, lua/common.lua), the buckets' and the sliding counters' charges (their flush), the
-- leases taken (leases_flush, lua/leases.lua), the quotas' charges (quota_flush,
-- lua/entry.lua) and the fair shares' counts (flush_fair, lua/fair.lua).
local function flush_batch()
  flush_logs()
  token_bucket.flush()
  sliding_counter.flush()
  flush_leases()
  flush_quotas()
  flush_fair()
end

local function batch(KEYS, ARGV)
  call, floor = redis.call, math.floor
  expire_options = redis.REDIS_VERSION_NUM ~= nil
  if ARGV[1] == '' then
    local time = redis.call('TIME')
    now_us = time[1] * 1000000 + time[2]
    clock = floor(now_us / 1000)
  else
    now_us = tonumber(ARGV[1])
    clock = nil
  end
  now = floor(now_us / 1000)
  batch_keys, batch_args = KEYS, ARGV
  token_bucket.forget()
  sliding_counter.forget()
  forget_blocks()
  forget_logs()
  forget_leases()
  forget_markers()
  forget_quotas()
  forget_fair()
  overrides.begin()
  out[1], n = now, 1
  key_at, at = 0, 3 + tonumber(ARGV[2])

  -- One pcall for the run, not one per check: a check that raises an error (a key of the wrong
  -- type) gets it as its entry, and the run goes on after it. A check writes its entry only after
  -- its last Redis command, so a failed one left nothing in `out`.
  while true do
    local ok, failure = pcall(run_checks)
    if ok then
      break
    end
    if shape == nil then
      -- (What the checks before it did stands, as its commands do: their writes waiting in the
      -- batch go too.)
      flush_batch()
      batch_keys, batch_args = nil, nil
      return redis.error_reply('malformed batch: ' .. tostring(failure))
    end
    -- (A check by a run-time override may have failed on keys of its own.)
    batch_keys = KEYS
    if type(failure) == 'table' and failure.err ~= nil then
      failure = failure.err
    end
    out[n + 1] = -1
    out[n + 2] = tostring(failure)
    n = n + 2
    key_at = key_at + entry_keys
    at = at + 1
  end
  flush_batch()
  -- MessagePack takes the table as an array only if nothing follows item n: what an earlier
  -- call wrote past it (up to `kept`, its n), or a claimed check that failed after its peek's
  -- entry.
  local i = n + 1
  while i <= kept or out[i] ~= nil do
    out[i] = nil
    i = i + 1
  end
  kept = n
  -- The call's keys and arguments are not kept past it.
  batch_keys, batch_args = nil, nil
  return cmsgpack.pack(out)
end
