-- The end of every rate-limit script (see lua/head.lua): check every rule, then record in all or none.
local states = {}
local allowed = 1
if guard_stamp then
  allowed = 0
end
local refused_by_rules = false
-- The wait until every refusing rule admits the request; nil when one never will.
local longest_wait = 0
for i = 1, rules do
  local state = inspect(i, tonumber(ARGV[3 * i + 3]), tonumber(ARGV[3 * i + 4]), tonumber(ARGV[3 * i + 5]))
  states[i] = state
  if not state.fits then
    allowed = 0
    refused_by_rules = true
    local rule_wait = wait(state)
    if rule_wait == nil or longest_wait == nil then
      longest_wait = nil
    elseif rule_wait > longest_wait then
      longest_wait = rule_wait
    end
  end
end

-- A reservation: a request that may wait is recorded for the time it fits. Never a duplicate.
local delay = 0
if allowed == 0 and not guard_stamp and longest_wait and longest_wait <= max_delay then
  allowed = 1
  delay = longest_wait
end

local block_until = 0
if allowed == 1 then
  for i = 1, rules do
    commit(states[i], now + delay, now_us + delay * 1000)
  end
  if guard_window > 0 then
    guard_stamp = now + delay
    call('SET', guard_key, guard_stamp, 'PXAT', guard_stamp + guard_window)
  end
else
  for i = 1, rules do
    undo(states[i])
  end
  if block > 0 and refused_by_rules then
    block_until = now + block
    call('SET', block_key, block_until, 'PXAT', block_until)
  end
end

-- A refusing rule's retry counts to the end of a block it started.
local function retry_of(wait_ms)
  if block_until > 0 and block > wait_ms then
    return block
  end
  return wait_ms
end

local reply = {allowed, now, delay}
for i = 1, rules do
  local state = states[i]
  local retry = -1
  if allowed == 0 and not state.fits then
    retry = retry_of(wait(state) or tonumber(ARGV[3 * i + 4]))
  end
  local remaining, reset = report(state)
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
  reply[#reply + 1] = retry
end
if guard_window > 0 then
  if guard_stamp then
    local left = guard_stamp + guard_window - now
    reply[#reply + 1] = 0
    reply[#reply + 1] = left
    if allowed == 0 then
      reply[#reply + 1] = retry_of(left)
    else
      reply[#reply + 1] = -1
    end
  else
    reply[#reply + 1] = 1
    reply[#reply + 1] = 0
    reply[#reply + 1] = -1
  end
end
return reply
