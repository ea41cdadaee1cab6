-- Fair shares of one budget (after lua/common.lua, before lua/entry.lua, which calls it): who
-- asked in the budget's current window and the one before, how much (refused requests included),
-- what each was admitted this window, and the level shares stand at while the budget is
-- saturated. The arithmetic is src/store/memory/fair.rs's, step for step (read its header); the
-- budget's own count is a rule's counter of the check's algorithm, kept under its own key
-- (lua/entry.lua checks it as it checks a counted rule).
--
-- The shares key, a hash beside the budget's counter (both under the policy's hash tag, with
-- every tenant's keys, so a budget's checks run on one Cluster slot):
--   w          the current window (its start over the period)
--   a, b       units asked this window, and in the window before (0 when that one saw none)
--   l          the level shares stand at this window ('' while the budget isn't saturated)
--   r          1 once the absent tenants' shares were let go this window
--   <tenant>   `<weight> <window> <asked> <asked before> <used> <held> <held before>`: the last
--              window it asked in, what it asked then and in the window before, what it was
--              admitted then, and whether it was held back (a request refused: 1, else 0) then and before;
--              the field
--              is the tenant's key (`…:fair:s:<identity>`), a key of the check that is never
--              read as one
-- It lives to the end of the window after the last it was written in: after that, nothing in it
-- counts.
--
-- A batch reads a shares key once (its fields, and a tenant's when it first meets it; all of them
-- when a level is worked out, at most three times a window) and writes what its checks changed
-- in one HSET when it ends (fair_flush), as the quotas' charges are: a budget's checks of one
-- batch cost Redis two commands more than they would without it, not two each.

-- The shares the batch has read, by key: {window, asked, asked_before, level (false: none),
-- released, tenants (by field: {weight, window, asked, asked_before, used, held, held_before},
-- false: none), all
-- (every tenant read), changed (the fields to write), gone (the fields to delete), period, dirty}.
local fair_known = {}
-- The needs of a level being worked out ({need, weight} each), kept from call to call.
local fair_needs = {}

local function forget_fair()
  if next(fair_known) ~= nil then
    fair_known = {}
  end
end

-- A tenant's field's value as a table (nil for none, or text no crate wrote).
local function tenant_of_text(text)
  if not text then
    return nil
  end
  local weight, window, asked, before, used, held, held_before =
    string.match(text, '^(%d+) (%d+) (%d+) (%d+) (%d+) ([01]) ([01])$')
  if weight == nil then
    return nil
  end
  return {tonumber(weight), tonumber(window), tonumber(asked), tonumber(before), tonumber(used),
          tonumber(held), tonumber(held_before)}
end

-- The shares under `key`, for a budget of period `period` (ms), with tenant `field` read too.
local function shares_of(key, period, field)
  local shares = fair_known[key]
  if shares ~= nil then
    if shares.tenants[field] == nil and not shares.all then
      shares.tenants[field] = tenant_of_text(call('HGET', key, field)) or false
    end
    return shares
  end
  local stored = call('HMGET', key, 'w', 'a', 'b', 'l', 'r', field)
  shares = {
    window = tonumber(stored[1]) or 0, asked = tonumber(stored[2]) or 0,
    asked_before = tonumber(stored[3]) or 0, level = tonumber(stored[4]) or false,
    released = stored[5] == '1', tenants = {[field] = tenant_of_text(stored[6]) or false},
    all = false, changed = {}, gone = {}, period = period, dirty = false,
  }
  fair_known[key] = shares
  return shares
end

-- Reads every tenant of `shares` (under `key`) the batch hasn't met yet.
local function read_all(shares, key)
  if shares.all then
    return
  end
  local all = call('HGETALL', key)
  for j = 1, #all, 2 do
    local field = all[j]
    if #field > 1 and shares.tenants[field] == nil then
      shares.tenants[field] = tenant_of_text(all[j + 1]) or false
    end
  end
  shares.all = true
end

-- What `tenant` asked in `window` and the window before, and whether it was held back in either
-- (1 or 0), seen from `window` (a later one than its own, or its own).
local function asked_in(tenant, window)
  local since = window - tenant[2]
  if since <= 0 then
    return tenant[3], tenant[4], math.max(tenant[6], tenant[7])
  elseif since == 1 then
    return 0, tenant[3], tenant[6]
  end
  return 0, 0, 0
end

-- The level `L` at which Σ min(need, weight × L) over the needs is `budget` (false when every
-- need fits): level_of in src/store/memory/fair.rs.
local function level_of(budget, needs, count)
  for j = count + 1, #needs do
    needs[j] = nil
  end
  table.sort(needs, function(x, y)
    return x[1] / x[2] < y[1] / y[2]
  end)
  local left, weights = budget, 0
  for j = 1, count do
    weights = weights + needs[j][2]
  end
  for j = 1, count do
    local need, weight = needs[j][1], needs[j][2]
    local level = left / weights
    if need > weight * level then
      return level
    end
    left = left - need
    weights = weights - weight
  end
  return false
end

-- The level now (level_now in src/store/memory/fair.rs): each active tenant needs what it asked
-- in the window before, or so far in this one when more (`asking`, `cost`: the request being
-- judged), or, held back in either, more than any share; with `release`, a tenant that
-- asked for more than its share before and hasn't asked this window needs nothing.
local function level_now(shares, key, budget, asking, cost, release)
  read_all(shares, key)
  local window, count = shares.window, 0
  for field, tenant in pairs(shares.tenants) do
    if tenant then
      local asked_now, before, held = asked_in(tenant, window)
      if field == asking then
        asked_now = asked_now + cost
      end
      local weight = tenant[1]
      local need = held == 1 and math.huge or math.max(before, asked_now)
      if release and asked_now == 0 and shares.level and need >= weight * shares.level then
        need = 0
      end
      if need > 0 then
        count = count + 1
        local slot = fair_needs[count]
        if slot == nil then
          fair_needs[count] = {need, weight}
        else
          slot[1], slot[2] = need, weight
        end
      end
    end
  end
  return level_of(budget, fair_needs, count)
end

-- Starts window `window` of `shares` (under `key`): forgets the tenants quiet since before the
-- window before it, and sets the level from what was asked in the window before.
local function fair_roll(shares, key, budget, window)
  shares.asked_before = window == shares.window + 1 and shares.asked or 0
  shares.asked, shares.window, shares.released = 0, window, false
  read_all(shares, key)
  for field, tenant in pairs(shares.tenants) do
    if tenant and tenant[2] + 1 < window then
      shares.tenants[field] = false
      shares.gone[field] = true
      shares.changed[field] = nil
    end
  end
  shares.level = shares.asked_before >= budget and level_now(shares, key, budget, nil, 0, false)
end

-- Tenant `field`'s share of the budget (`budget` units per `period` ms) under `key` at `now`, of
-- weight `weight` (nil for a call that doesn't weigh, as a give-back: the weight its latest check
-- gave, 1 for a new tenant), for a request of `cost` units (share in src/store/memory/fair.rs):
-- what it may
-- use this window (nil while the budget isn't saturated), what it has used, and the time until
-- the window ends (ms); and the shares.
local function fair_share(key, field, budget, period, weight, cost)
  local shares = shares_of(key, period, field)
  local window = floor(now / period)
  if window ~= shares.window then
    fair_roll(shares, key, budget, window)
  end
  local tenant = shares.tenants[field]
  if tenant then
    if tenant[2] ~= window then
      local asked, before = asked_in(tenant, window)
      local held_before = window - tenant[2] == 1 and tenant[6] or 0
      tenant[2], tenant[3], tenant[4], tenant[5] = window, asked, before, 0
      tenant[6], tenant[7] = 0, held_before
    end
    tenant[1] = weight or tenant[1]
  else
    tenant = {weight or 1, window, 0, 0, 0, 0, 0}
    shares.tenants[field] = tenant
    shares.gone[field] = nil
  end
  local into = now % period
  if shares.level and not shares.released and into >= floor(period / 10) then
    shares.released = true
    shares.level = level_now(shares, key, budget, field, cost, true)
  end
  if not shares.level and shares.asked + cost >= budget then
    shares.level = level_now(shares, key, budget, field, cost, false)
  end
  -- (What it rolled, set or met is kept, whatever the call: a peek's too, as the memory store
  -- keeps it; a level is set by whoever asks first.)
  shares.dirty = true
  shares.changed[field] = true
  local cap = shares.level and floor(tenant[1] * shares.level) or nil
  return cap, tenant[5], period - into, shares
end

-- Counts a request of tenant `field` of `cost` units that reached the budget (its own limits
-- admitted it), `admitted` or not: what it asked, what it used, and whether it was held back.
local function fair_count(shares, field, cost, admitted)
  shares.asked = shares.asked + cost
  local tenant = shares.tenants[field]
  if tenant then
    tenant[3] = tenant[3] + cost
    if admitted then
      tenant[5] = tenant[5] + cost
    else
      tenant[6] = 1
    end
    shares.changed[field] = true
  end
  shares.dirty = true
end

-- Gives back `cost` units tenant `field` used in the window of `charged` (ms), if that is the
-- window the shares under `key` are in.
local function fair_give_back(key, field, period, cost, charged)
  local shares = shares_of(key, period, field)
  local tenant = shares.tenants[field]
  if tenant and tenant[2] == shares.window and floor(charged / period) == shares.window then
    tenant[5] = math.max(tenant[5] - cost, 0)
    shares.changed[field] = true
    shares.dirty = true
  end
end

-- Writes what the batch's calls changed of the shares.
local function flush_fair()
  for key, shares in pairs(fair_known) do
    if shares.dirty then
      local level = shares.level and string.format('%.17g', shares.level) or ''
      local fields = {'HSET', key, 'w', text_of(shares.window), 'a', text_of(shares.asked),
                      'b', text_of(shares.asked_before), 'l', level,
                      'r', shares.released and '1' or '0'}
      for field in pairs(shares.changed) do
        local tenant = shares.tenants[field]
        if tenant then
          fields[#fields + 1] = field
          fields[#fields + 1] = string.format('%d %d %d %d %d %d %d', tenant[1], tenant[2],
                                              tenant[3], tenant[4], tenant[5], tenant[6], tenant[7])
        end
      end
      call(unpack(fields))
      local gone = {}
      for field in pairs(shares.gone) do
        if not shares.tenants[field] then
          gone[#gone + 1] = field
        end
      end
      if #gone > 0 then
        call('HDEL', key, unpack(gone))
      end
      -- (Relative to the batch's time, which tests may fix.)
      call('PEXPIRE', key, text_of(math.max((shares.window + 2) * shares.period - now, 1)))
      shares.dirty, shares.changed, shares.gone = false, {}, {}
    end
  end
end
