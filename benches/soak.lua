-- wrk script of the soak run (benches/soak.sh): the n-th request of a connection comes from
-- identity (n * connections + connection) % 100 000, so every identity is seen in turn.
local identities = 100000
local sent = 0

setup = function(thread)
  thread:set("offset", math.random(0, identities - 1))
end

request = function()
  sent = sent + 1
  local user = (sent + (offset or 0)) % identities
  return wrk.format(nil, nil, { ["x-user-id"] = "user-" .. user })
end
