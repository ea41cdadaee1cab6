-- Claims (after lua/entry.lua and lua/fast.lua, before lua/batch.lua): metered calls waiting for
-- room keep their place. A metered call that finds no room leaves a claim, and the calls that ask
-- after it, on any instance, see the room less the units it waits for; so a large call is not
-- starved by small ones that keep taking the room it waits for. Nothing is reserved: a claim
-- charges nothing, and it goes when its call is admitted, gives up, or its time to wait is over.
-- `run_claimed(shape, base, claim, n)` runs a check that carries one.
--
-- The claims key (after the check's own keys, outside its shape's count): a sorted set of
-- `<id>:<units>:<expiry ms>`, scored by when each claim was made (µs, a batch's time), so in the
-- order the calls first asked. Its expiry is at least its last claim's.
--
-- A check with claim `id` fits only if the room left holds the units of the live claims ahead of
-- it (every live claim when it has none) and its own: first a peek of its units plus theirs, then,
-- if that fits, the check itself. A refused check makes its claim if it has none (lasting
-- `lasting` ms); an admitted one takes its claim away. `lasting` 0: the call gave up: its claim
-- goes, and it is answered as a peek.

-- The units of the live claims ahead of claim `id` (all live claims if `id` has none), and its
-- member if it has one; expired claims found on the way are removed.
local function claims_ahead(key, id)
  local held = call('ZRANGE', key, 0, -1)
  local ahead, mine = 0, nil
  for j = 1, #held do
    local member = held[j]
    local their_id, units, expiry = string.match(member, '^(%d+):(%d+):(%d+)$')
    if their_id == nil or tonumber(expiry) <= now then
      call('ZREM', key, member)
    elseif their_id == id then
      mine = member
      break
    else
      ahead = ahead + tonumber(units)
    end
  end
  return ahead, mine
end

-- `shape` as a peek whose metered rules (and metered quota) count `more` units on top: a
-- request's costs without metered units (no claim applies to them) stay as they are.
-- Past a token bucket's burst, it answers the wait until the units ahead have gone and its own
-- have dripped back, not "never" (lua/token_bucket.lua): they go one call after another.
local function peek_with_more(shape, more)
  local costs, piece = shape.costs, shape.cost_piece
  -- (rawget: a plain cost's table answers any index with the cost.)
  local flags = rawget(piece, 'flags')
  if flags ~= nil then
    costs = costs_of(string.format('%d:%d:%s', piece.request, piece.units + more, flags))
  end
  -- (A metered budget shared fairly counts the units ahead too, as the rules do.)
  local fair_cost = shape.fair_metered == 1 and shape.fair_cost + more or shape.fair_cost
  return setmetatable({kind = KIND_PEEK, costs = costs, quota_cost = costs[shape.rules + 1],
                       fair_cost = fair_cost, past_burst = true}, {__index = shape})
end

-- Makes `claim` of a check of `shape` (refused, with none yet): placed after every claim made
-- before, lasting its time to wait.
local function make_claim(key, shape, claim)
  local expiry = now + claim.lasting
  local units = rawget(shape.cost_piece, 'units') or 0
  call('ZADD', key, now_us, string.format('%s:%d:%d', claim.claim, units, expiry))
  expire_at_least(key, expiry)
end

-- Whether the entry written from out[n + 1] on admits its request (a short form, or a long one
-- saying allowed).
local function admits(n)
  return out[n + 1] >= 0 or out[n + 2] == 1
end

-- Runs the check of `shape` whose keys follow KEYS[base], its claims key after them, carrying
-- `claim` ({claim = id (text), lasting = ms}); writes its entry after out[n] and returns the index
-- of its last item.
local function run_claimed(shape, base, claim, n)
  local key = batch_keys[base + shape.keys + 1]
  local ahead, mine = claims_ahead(key, claim.claim)
  if claim.lasting == 0 then
    if mine then
      call('ZREM', key, mine)
    end
    return run_entry(peek_with_more(shape, 0), base, nil, n)
  end
  if ahead > 0 then
    local m = run_entry(peek_with_more(shape, ahead), base, nil, n)
    if not admits(n) then
      if mine == nil then
        make_claim(key, shape, claim)
      end
      return m
    end
    -- It fits with the claims ahead: the check itself, in place of the peek's entry.
    for i = n + 1, m do
      out[i] = nil
    end
  end
  local m = shape.lean and shape.lean(batch_keys, base, shape, now, out, n, nil)
  if not m then
    m = run_entry(shape, base, nil, n)
  end
  if admits(n) then
    if mine then
      call('ZREM', key, mine)
    end
  elseif mine == nil then
    make_claim(key, shape, claim)
  end
  return m
end
