#!/usr/bin/env bash
# Exact under a blast: two demo servers on one Redis (a server of the script's own), a global
# fixed window of 3 000 per 20 s with `prefetch = 100`, both blasted by wrk with 32 connections
# each for 3 s inside one window. Prints what each admitted (2xx) and refused (429), and checks
# that all together admitted at most 3 000 and at least 3 000 less what two instances can hold
# (2 x 100). Repeats for [rounds] windows.
#
#   bash benches/prefetch_blast.sh [rounds, default 3]
#
# Needs wrk, redis-server and redis-cli; only loopback is targeted.
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/load_lib.sh
require_wrk

rounds=${1:-3}
ports=(38380 38381)
redis_port=41300
limit=3000
prefetch=100

cargo build --release --example demo --all-features -q
demo=target/release/examples/demo

work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null; rm -rf "$work"' EXIT

start_own_redis "$redis_port" "$work"

for port in "${ports[@]}"; do
  cat >"$work/$port.toml" <<TOML
listen = "127.0.0.1:$port"
store = "redis://127.0.0.1:$redis_port/0"
on_store_error = "deny"
prefix = "blast-$$"
trusted_proxies = []

[[routes]]
path = "/api/ping"
key = "global"
algorithm = "fixed_window"
rules = [{ limit = $limit, period = "20s" }]
prefetch = $prefetch
TOML
  RUST_LOG=warn "$demo" --config "$work/$port.toml" >/dev/null 2>"$work/$port.log" &
  wait_for_http "http://127.0.0.1:$port/healthz"
done

# admitted WRK_OUTPUT: the 2xx answers in a wrk report (every other answer counts as non-2xx).
admitted() {
  local total refused
  total=$(awk '/requests in/ {print $1}' "$1")
  refused=$(awk '/Non-2xx or 3xx responses/ {print $5}' "$1")
  echo $((total - ${refused:-0}))
}

failed=0
for round in $(seq 1 "$rounds"); do
  # 100 ms into a window of 20 s (windows start at multiples of 20 s of Unix time).
  now_ms=$(($(date +%s%N) / 1000000))
  sleep "$(awk -v ms="$(((20100 - now_ms % 20000) % 20000))" 'BEGIN { printf "%.3f", ms / 1000 }')"
  blasts=()
  for port in "${ports[@]}"; do
    wrk -t1 -c32 -d3s "http://127.0.0.1:$port/api/ping" >"$work/wrk-$port" 2>&1 &
    blasts+=($!)
  done
  wait "${blasts[@]}"
  first=$(admitted "$work/wrk-${ports[0]}")
  second=$(admitted "$work/wrk-${ports[1]}")
  total=$((first + second))
  requests=$(cat "$work"/wrk-* | awk '/requests in/ {n += $1} END {print n}')
  verdict=ok
  if ((total > limit || total < limit - 2 * prefetch)); then verdict=FAILED; failed=1; fi
  echo "round $round: admitted $first + $second = $total of $limit ($requests requests) $verdict"
done
exit "$failed"
