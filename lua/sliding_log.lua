-- Sliding-window log (between lua/head.lua and lua/tail.lua). A counted rule's key is a sorted set
-- of admissions, one member per unit, scored by time (ms). An admission at t counts while
-- t + period > now, as in the in-memory store; a log never holds more than its rule's limit of
-- members. Reservations (a max delay) are admissions scored in the future.
-- A request of cost 0 adds nothing, but still gets the key's expiry.

-- The score of the n-th oldest admission (1-based), or nil.
local function nth_oldest(key, n)
  local found = call('ZRANGE', key, n - 1, n - 1, 'WITHSCORES')
  return tonumber(found[2])
end

local function inspect(i, limit, period)
  local key = KEYS[i]
  call('ZREMRANGEBYSCORE', key, '-inf', now - period)
  local count = call('ZCARD', key)
  return {key = key, limit = limit, period = period, count = count, fits = count + cost <= limit}
end

local function wait(state)
  if cost > state.limit then
    return nil
  end
  -- The request fits once `count + cost - limit` of the oldest admissions leave the window.
  return nth_oldest(state.key, state.count + cost - state.limit) + state.period - now
end

-- ZADD takes members in batches, so a costly request never overflows Lua's stack with unpack.
local BATCH = 1000

-- Adds `units` members scored `at`, named `at-<n>` for n from `first` on; returns how many were
-- new (a name already taken is not added again).
local function add_members(key, at, first, units)
  local added = 0
  local done = 0
  while done < units do
    local members = {}
    for _ = 1, math.min(BATCH, units - done) do
      members[#members + 1] = at
      members[#members + 1] = at .. '-' .. (first + done)
      done = done + 1
    end
    added = added + call('ZADD', key, unpack(members))
  end
  return added
end

local function commit(state, at)
  -- Members at one score need distinct names. Numbering them after the log's count works while
  -- time only moves forward, the common case; when names were taken (a clock that stepped back, a
  -- reservation made earlier for the same millisecond), the rest go after the highest number at
  -- that score.
  local created = state.count == 0
  local added = add_members(state.key, at, state.count + 1, cost)
  if added < cost then
    local highest = 0
    for _, member in ipairs(call('ZRANGEBYSCORE', state.key, at, at)) do
      highest = math.max(highest, tonumber(string.match(member, '-(%d+)$')) or 0)
    end
    add_members(state.key, at, highest + 1, cost - added)
  end
  state.count = state.count + cost
  -- The newest admission leaves the window one period after it.
  expire_at_least(state.key, at + state.period, created)
end

local function undo()
end

local function report(state)
  local oldest = nth_oldest(state.key, 1)
  local reset = 0
  if oldest then
    reset = oldest + state.period - now
  end
  return math.max(state.limit - state.count, 0), reset
end
