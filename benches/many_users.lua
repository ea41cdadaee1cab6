-- wrk script of the many-identities scenario (benches/load_peers.sh): every request comes from
-- one of 10 000 identities at random, in the `x-user-id` header that `load_server --by-user`
-- keys by.
math.randomseed(os.time())

request = function()
  return wrk.format(nil, nil, { ["x-user-id"] = "user-" .. math.random(1, 10000) })
end
