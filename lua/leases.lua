-- A concurrency limit's leases (max_in_flight): one list per identity and policy, its key
-- `…:leases`, one item per request in flight, its lease id. An id is when its lease expires, in
-- µs (its expiry in ms, `floor(id / 1000)`, is what counts), made unique on its key by taking one
-- past the last (below 2^53 until the year 2255, so Lua's numbers hold it whole). Ids grow with
-- Redis's clock: a later batch's leases get ids past every id an earlier one handed out (each
-- take costs Redis more than a µs), so a lease released twice, the second time late, can't end
-- one taken since. A lease expires no earlier than those taken before it on its key, so the list
-- is in expiry order as it is in take order: a lease is taken at the tail (RPUSH, whatever the
-- list holds), the earliest is the head, the expired ones lead the list, and a release (LREM)
-- mostly finds its lease among the first, since requests end about in the order they started.
-- (A sorted set did the same at O(n) per ZADD below 128 members: the hottest command of a
-- concurrency limit.) The leases a batch takes wait in it and go in one RPUSH, before anything
-- else reads or changes the list, or when the batch ends (leases_flush).

-- The expiry (ms) of each lease id the batch has made or read, by its text: reading a number
-- from 16 digits costs Redis about as much as a plain check's own Lua (tonumber goes through
-- strtod), and a hot key's check reads its earliest lease's at each check. Forgotten at each batch.
local expiry_known = {}

-- The lease id's expiry (ms), from its text.
local function expiry_of(id)
  local expiry = expiry_known[id]
  if expiry == nil then
    expiry = floor(tonumber(id) / 1000)
    expiry_known[id] = expiry
  end
  return expiry
end

-- The texts of the three last digits of an id ('000' to '999'), made as needed, and the text of
-- the last expiry (ms) an id was made for: an id's text is the two joined, which costs Redis a
-- fraction of formatting the whole number (string.format, needed: Lua's own text of a number
-- this large is in exponent form). Only a window that holds a whole list needs an id's text; the
-- list gets its ids as numbers (leases_flush).
local last_digits = {}
local made_ms, made_ms_text

-- The text of lease id `id` (a number of 16 digits or so), whose expiry is `expiry`.
local function id_text(id, expiry)
  if expiry ~= made_ms then
    made_ms, made_ms_text = expiry, string.format('%d', expiry)
  end
  local low = id - expiry * 1000
  local digits = last_digits[low]
  if digits == nil then
    digits = string.format('%03d', low)
    last_digits[low] = digits
  end
  return made_ms_text .. digits
end

-- The leases of each key the batch has read (why they hold: logs_known, lua/common.lua): how
-- many are held; a window on the first ids of the list (up to LEASE_WINDOW, as text, from `from`
-- on: the ones before it were released), and whether it holds them all; the last id taken (a
-- number; nil: not read), the expiry the batch gave the key, the ids taken but not yet pushed
-- (numbers, in order, pushed as they are) and the earliest's expiry while takes are all that
-- changed the list since it was read (nil: ask leases_current). Forgotten at each batch.
local LEASE_WINDOW = 16
local leases_held, leases_window, leases_from, leases_whole, leases_tail, leases_expiry =
  {}, {}, {}, {}, {}, {}
local leases_pending, leases_earliest = {}, {}

local function forget_leases()
  if next(leases_window) ~= nil then
    leases_held, leases_window, leases_from, leases_whole, leases_tail, leases_expiry =
      {}, {}, {}, {}, {}, {}
    leases_pending, leases_earliest = {}, {}
  end
  if next(expiry_known) ~= nil then
    expiry_known = {}
  end
end

-- Pushes the leases of `key` the batch took and hasn't pushed, and gives the key their expiry
-- (the last one's: the latest). Run before any other command on the list, and at the batch's end.
local function leases_flush(key)
  local pending = leases_pending[key]
  if pending == nil then
    return
  end
  leases_pending[key] = nil
  local count, length = pending.n, nil
  local expires = floor(pending[count] / 1000)
  -- (As numbers: Redis writes an argument that is an integer below 2^53 in all its digits, as
  -- id_text does, for a fraction of what making its text in Lua costs.)
  for first = 1, count, ZADD_BATCH do
    length = call('RPUSH', key, unpack(pending, first, math.min(first + ZADD_BATCH - 1, count)))
  end
  -- A list the push made (it held nothing) takes the expiry; one that holds others keeps one
  -- this batch set already, as late.
  local set = leases_expiry[key]
  local created = length == count
  if created or not set or expires > set then
    expire_at_least(key, expires, created)
    leases_expiry[key] = expires
  end
end

-- leases_flush of every key with leases waiting: at the batch's end.
local function flush_leases()
  if next(leases_pending) ~= nil then
    for key in pairs(leases_pending) do
      leases_flush(key)
    end
  end
end

-- Reads the window on the first leases of `key` (see leases_held), `size` of them (nil:
-- LEASE_WINDOW), and returns it.
local function leases_read(key, size)
  leases_flush(key)
  size = math.max(size or LEASE_WINDOW, LEASE_WINDOW)
  local window = call('LRANGE', key, 0, size - 1)
  leases_window[key], leases_from[key], leases_earliest[key] = window, 1, nil
  leases_whole[key] = #window < size
  return window
end

-- The leases of `key`, those past their expiry gone (their requests ended without a word, their
-- instance died): how many are held, and when the earliest expires (nil: none is held). The
-- earliest is read first: only when it has expired do the expired ones go (LTRIM), and a key
-- that holds none is not there to count. Read once per batch (`size` of them first, at least
-- LEASE_WINDOW), and again only when the releases of a batch emptied the window on the first.
local function leases_current(key, size)
  local held, window = leases_held[key], leases_window[key]
  if held ~= nil and window ~= nil then
    -- (What the batch knows, while its earliest has not expired: every check of a hot key but
    -- its batch's first. The loop below would find the same.)
    local first = window[leases_from[key]]
    if first ~= nil then
      local earliest = expiry_of(first)
      if earliest > now then
        return held, earliest
      end
    end
  end
  if window == nil then
    window = leases_read(key, size)
  end
  while true do
    local from = leases_from[key]
    if window[from] == nil and not leases_whole[key] then
      window = leases_read(key)
      from = 1
    end
    local past = from
    while window[past] ~= nil and expiry_of(window[past]) <= now do
      past = past + 1
    end
    if past == from then
      break
    end
    leases_flush(key)
    call('LTRIM', key, past - from, -1)
    leases_from[key] = past
    held = held and held - (past - from)
  end
  local first = window[leases_from[key]]
  local earliest = first and expiry_of(first)
  if first == nil then
    held = 0
  elseif held == nil then
    leases_flush(key)
    held = call('LLEN', key)
  end
  leases_held[key], leases_earliest[key] = held, earliest
  return held, earliest
end

-- The leases of `key` as leases_current counts them, for a peek, which changes nothing: how many
-- have not expired, and when the earliest of them expires (nil: none).
local function leases_peek(key)
  leases_flush(key)
  local expired = 0
  while true do
    local window = call('LRANGE', key, expired, expired + LEASE_WINDOW - 1)
    for i = 1, #window do
      local expires = expiry_of(window[i])
      if expires > now then
        return call('LLEN', key) - expired, expires
      end
      expired = expired + 1
    end
    if #window < LEASE_WINDOW then
      return 0, nil
    end
  end
end

-- Takes a lease of the leases `key` expiring at `expires` (ms) or, to keep the list in expiry
-- order, with the last lease taken on it if that expires later. `held` and `earliest` are what
-- leases_current read. Returns its id, and the leases held and the earliest's expiry after.
local function lease_take(key, held, earliest, expires)
  local tail = leases_tail[key]
  if tail == nil then
    local window = leases_window[key]
    if held == 0 then
      tail = 0
    elseif leases_whole[key] and window[#window] ~= nil then
      tail = tonumber(window[#window])
    else
      leases_flush(key)
      tail = tonumber(call('LINDEX', key, -1))
    end
  end
  local id = math.max(expires * 1000 + now_us % 1000, tail + 1)
  local pending = leases_pending[key]
  if pending == nil then
    leases_pending[key] = {id, n = 1}
  else
    local count = pending.n + 1
    pending[count], pending.n = id, count
  end
  leases_tail[key] = id
  held = held + 1
  leases_held[key] = held
  earliest = earliest or floor(id / 1000)
  if leases_whole[key] then
    local window = leases_window[key]
    window[#window + 1] = id_text(id, floor(id / 1000))
    -- (A window that holds them all is where the earliest is read.)
    leases_earliest[key] = nil
  else
    leases_earliest[key] = earliest
  end
  return id, held, earliest
end

-- A take of a hot key, as leases_current and lease_take would make it, for every check of a key
-- but its batch's first (that one, and any check after a release or a read of the list, goes
-- the long way): the lease's id, and the leases held after; nil when there is no lease to take
-- (`max_in_flight` are held) or the batch doesn't know the key's leases as they stand. `expires`
-- as lease_take's. The earliest lease's expiry is the one the batch knows.
local function lease_take_known(key, max_in_flight, expires)
  local pending, earliest = leases_pending[key], leases_earliest[key]
  if pending == nil or earliest == nil or earliest <= now then
    return nil
  end
  local held = leases_held[key]
  if held >= max_in_flight then
    return nil
  end
  local id = leases_tail[key] + 1
  local base = expires * 1000 + now_us % 1000
  if id < base then
    id = base
  end
  local count = pending.n + 1
  pending[count], pending.n = id, count
  leases_tail[key] = id
  held = held + 1
  leases_held[key] = held
  return id, held, earliest
end

-- Releases the lease `id` (its text) of the leases `key`: 1 if it was held, else 0 (one that
-- expired or was released already). A batch that holds the whole list knows without asking.
local function lease_release(key, id)
  leases_flush(key)
  local held, window, from = leases_held[key], leases_window[key], leases_from[key]
  local at = nil
  if held then
    for i = from, #window do
      if window[i] == id then
        at = i
        break
      end
    end
    if at == nil and leases_whole[key] then
      return 0
    end
  end
  local released = call('LREM', key, 1, id)
  if released == 1 and tonumber(id) == leases_tail[key] then
    -- (The next lease follows the list's last, read again.)
    leases_tail[key] = nil
  end
  if released == 1 and held then
    leases_held[key] = held - 1
    if at == from then
      leases_from[key] = from + 1
    elseif at ~= nil then
      table.remove(window, at)
    end
  end
  return released
end

-- Releases the leases `ids` of the leases `key`, their texts apart by spaces (a batch's releases
-- of one key go as one entry, in ascending order: src/store/redis/merge.rs): how many were held.
-- Most often they are the list's first leases (requests end about in the order they started),
-- which one comparison of their text finds and one LTRIM ends; otherwise those at its head end
-- in one LTRIM each time the window on its first leases runs out, and any other as
-- lease_release ends it.
local function leases_release(key, ids)
  local space = string.find(ids, ' ', 1, true)
  if space == nil then
    if not string.find(ids, '^%d+$') then
      error('malformed lease id ' .. ids)
    end
    return lease_release(key, ids)
  end
  -- How many, if they are as long as the first (as they are but across a power of ten): a
  -- guess, which the comparison below proves (equal, the ids are that many of the list's, joined)
  -- before anything is ended, and which costs Redis a fraction of counting the spaces.
  local count = floor((#ids + 1) / space)
  -- (The expired ones go first: a release finds them gone. One more than the ids is read, so
  -- that ending them all says whether the list is empty.)
  leases_current(key, count + 1)
  leases_flush(key)
  local window, from = leases_window[key], leases_from[key]
  if window[from + count] == nil and not leases_whole[key] then
    window, from = leases_read(key, count + 1), 1
  end
  local last = from + count - 1
  if window[last] ~= nil and table.concat(window, ' ', from, last) == ids then
    call('LTRIM', key, count, -1)
    leases_from[key] = last + 1
    leases_held[key] = leases_held[key] - count
    if window[last + 1] == nil and leases_whole[key] then
      -- (The list is empty: the next lease follows none.)
      leases_tail[key] = nil
    end
    return count
  end
  if string.find(ids, '[^%d ]') then
    error('malformed lease ids ' .. ids)
  end
  local ending, left = {}, 0
  for id in string.gmatch(ids, '%d+') do
    if not ending[id] then
      ending[id] = true
      left = left + 1
    end
  end
  local released = 0
  while left > 0 do
    local window, from = leases_window[key], leases_from[key]
    local past = from
    while window[past] ~= nil and ending[window[past]] do
      ending[window[past]] = nil
      past = past + 1
    end
    local ended = past - from
    if ended == 0 then
      break
    end
    call('LTRIM', key, ended, -1)
    leases_from[key] = past
    leases_held[key] = leases_held[key] - ended
    left, released = left - ended, released + ended
    if window[past] ~= nil then
      break
    elseif leases_whole[key] then
      -- (The list is empty: the next lease follows none.)
      leases_tail[key] = nil
      break
    end
    leases_read(key, left + 1)
  end
  for id in pairs(ending) do
    released = released + lease_release(key, id)
  end
  return released
end
