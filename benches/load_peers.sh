#!/usr/bin/env bash
# Loopback load run of this crate next to its peers, interleaved in one run (benches/load_server):
# bare axum, tower_governor (in memory; and with its x-ratelimit-* headers, `governor-headers`, like
# for like with this crate's), a naive Redis middleware (one EVALSHA of INCR + PEXPIRE on
# a shared ConnectionManager), the two published Redis-backed tower limiters (trl-redis:
# tower-rate-limit-redis, GCRA in one EVALSHA with TIME on a redis-rs MultiplexedConnection;
# trl-fred: tower-rate-limit-fred, the same script through a Fred pool of 4; both keyed per
# connection, as their u16 capacity would refuse one hot key), and this crate on its memory and
# Redis stores (and on Redis with prefetch(100): the hot key's units taken ahead). Each at 64
# connections and at 1, with one hot key (every request from 127.0.0.1); a rejection flood (every
# request after the first refused; for the trl-* peers, after the first of each connection); and
# many identities (-users: 10 000 at random in x-user-id, benches/many_users.lua, every server
# keyed by it, at 64 connections). The demo (examples/demo.rs, as users run it: a config route over
# the layer) runs too: `demo-bare` with --no-limiter, `demo` on the memory store (fixed window,
# one rule, keyed by IP), `demo-flood` refusing all but its first request, `demo-redis` and
# `demo-redis-tb` on the run's Redis (a fixed window, and a token bucket beside the trl-* peers'
# GCRA); their ratio is to demo-bare's req/s. `static-429-c64` answers every request with the flood's 429, prebuilt, and
# no limiter: the floor of a flood that answers with it.
#
#   bash benches/load_peers.sh [seconds per run, default 5] [rounds, default 3] [setups, a regex]
#   LOAD_SERVER=/tmp/load-server DEMO=/tmp/demo bash benches/load_peers.sh ...   # binaries built before
#
# Prints req/s, p50/p99, and the CPU time per request of the server, of redis-server (a server
# of the script's own) and of wrk for each run, then medians over the rounds with req/s as a ratio to bare
# axum at the same connection count. The medians also go to benches/peers/medians.tsv, from which
# scripts/pictures draws the guide's bar chart (docs/pictures/performance.svg). Needs wrk and
# redis-server; only loopback is targeted.
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/load_lib.sh
require_wrk

seconds=${1:-5}
rounds=${2:-3}
only=${3:-.}
port=38280
redis_port=41100

# LOAD_SERVER and DEMO may name binaries built elsewhere (an earlier commit's, to compare).
server=${LOAD_SERVER:-target/release/load-server}
demo=${DEMO:-target/release/examples/demo}
[[ -n ${LOAD_SERVER:-} ]] || cargo build --release -p load-server -q
[[ -n ${DEMO:-} ]] || cargo build --release --example demo --all-features -q

work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null; rm -rf "$work"' EXIT

start_own_redis "$redis_port" "$work"
redis_pid=$!
redis_url="redis://127.0.0.1:$redis_port/0"

# setup LABEL MODE CONNECTIONS [--refuse]: one run; prints measure's line.
setup() {
  local label=$1 mode=$2 connections=$3; shift 3
  redis-cli -p "$redis_port" flushall >/dev/null
  if [[ $mode == demo* ]]; then
    demo_config "$@" >"$work/$label.toml"
    local bare=()
    [[ $mode == demo-bare ]] && bare=(--no-limiter)
    RUST_LOG=info "$demo" --config "$work/$label.toml" "${bare[@]}" >/dev/null 2>"$work/$label.log" &
  else
    RUST_LOG=info "$server" "$mode" "127.0.0.1:$port" --redis "$redis_url" "$@" \
      >/dev/null 2>"$work/$label.log" &
  fi
  local pid=$!
  wait_for_http "http://127.0.0.1:$port/healthz"
  local redis_pids=()
  [[ $mode == naive || $mode == trl-* || $mode == redis* || $* == *--redis* ]] &&
    redis_pids=("$redis_pid")
  if [[ $* == *--refuse* ]]; then export ALLOW_REFUSED=1; else unset ALLOW_REFUSED; fi
  if [[ $* == *--by-user* ]]; then export WRK_SCRIPT=benches/many_users.lua; else unset WRK_SCRIPT; fi
  measure "$label" "http://127.0.0.1:$port/api/ping" "$seconds" "$connections" "$pid" "${redis_pids[@]}"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

# The demo's config: one route on the memory store, fixed window, keyed by IP; a limit no run
# reaches, or with --refuse one request per hour. With --redis the route is on the run's Redis;
# with --token-bucket its rule is a token bucket (the GCRA peers' algorithm), whose limit a
# bucket refills at most a unit a microsecond: per hour.
demo_config() {
  local limit=1000000000 period=1s store=memory algorithm=fixed_window
  [[ $* == *--refuse* ]] && limit=1 period=1h
  [[ $* == *--redis* ]] && store=$redis_url
  [[ $* == *--token-bucket* ]] && algorithm=token_bucket period=1h
  cat <<TOML
listen = "127.0.0.1:$port"
store = "$store"
prefix = "peers"
trusted_proxies = []
legacy_headers = false

[[routes]]
path = "/api/ping"
key = "ip"
algorithm = "$algorithm"
rules = [{ limit = $limit, period = "$period" }]
TOML
}

setups=()
for connections in 64 1; do
  for mode in bare governor governor-headers memory naive trl-redis trl-fred redis redis-prefetch; do
    setups+=("$mode-c$connections|$mode|$connections|")
  done
done
for mode in governor governor-headers memory naive trl-redis trl-fred redis; do
  setups+=("$mode-flood|$mode|64|--refuse")
done
setups+=("demo-bare-c64|demo-bare|64|" "demo-c64|demo|64|" "demo-flood|demo|64|--refuse")
# The demo on Redis: a fixed window, and a token bucket beside the GCRA peers (trl-*), like for
# like.
setups+=("demo-redis-c64|demo|64|--redis" "demo-redis-tb-c64|demo|64|--redis,--token-bucket")
# The flood's 429 with no limiter (prebuilt): what its bytes cost over PONG, any limiter's floor.
setups+=("static-429-c64|static-429|64|--refuse")
# Many identities: 10 000 at random in x-user-id, every server keyed by it, at 64 connections.
for mode in bare governor governor-headers memory naive trl-redis trl-fred redis redis-prefetch; do
  setups+=("$mode-users|$mode|64|--by-user")
done
selected=()
for entry in "${setups[@]}"; do
  [[ ${entry%%|*} =~ $only ]] && selected+=("$entry")
done
setups=("${selected[@]}")

printf '%-6s %-16s %10s %9s %9s %14s %14s %12s\n' round setup "req/s" p50 p99 "server µs/req" "redis µs/req" \
  "wrk µs/req"
for round in $(seq 1 "$rounds"); do
  # The order rotates each round, so no setup always runs first or last.
  for i in $(seq 0 $((${#setups[@]} - 1))); do
    IFS='|' read -r label mode connections extra <<<"${setups[$(((i + round - 1) % ${#setups[@]}))]}"
    # shellcheck disable=SC2086 # $extra is one flag or nothing
    read -r _ rps p50 p99 server_us redis_us wrk_us < <(setup "$label" "$mode" "$connections" $extra) || true
    [[ -n ${wrk_us:-} ]] || { echo "the $label run failed (see above)" >&2; exit 1; }
    printf '%-6s %-16s %10s %9s %9s %14s %14s %12s\n' "$round" "$label" "$rps" "$p50" "$p99" "$server_us" \
      "$redis_us" "$wrk_us"
    echo "$label $rps $server_us $redis_us $p50 $wrk_us" >>"$work/results"
  done
done

echo
echo "medians over $rounds rounds; ratio: req/s over bare axum's at the same connections (floods: at 64);"
echo "vs naive: req/s and redis µs/req over the naive middleware's in the same load"
printf '%-16s %10s %8s %10s %14s %14s %12s %10s %10s\n' setup "req/s" ratio p50 "server µs/req" \
  "redis µs/req" "wrk µs/req" "vs naive" "redis vs"
mkdir -p benches/peers
medians=benches/peers/medians.tsv
printf 'setup\treq_s\tvs_bare\tp50_us\tserver_us\tredis_us\twrk_us\tvs_naive\n' >"$medians"
for entry in "${setups[@]}"; do
  label=${entry%%|*}
  column() { awk -v l="$label" -v c="$1" '$1 == l {print $c}' "$work/results"; }
  rps=$(column 2 | median)
  server_us=$(column 3 | median)
  redis_us=$(column 4 | median)
  wrk_us=$(column 6 | median)
  # p50 as wrk prints it (us or ms): the median of the values in microseconds.
  p50=$(column 5 | awk '/ms$/ {sub("ms", ""); print $1 * 1000; next} /us$/ {sub("us", ""); print $1; next} {print $1 * 1e6}' | median)
  bare=$label
  case $label in
    demo-*) bare=demo-bare-c64 ;;
    *-flood) bare=bare-c64 ;;
    *) bare="bare-${label##*-}" ;;
  esac
  bare_rps=$(awk -v l="$bare" '$1 == l {print $2}' "$work/results" | median)
  # ratio A B: A / B with two decimals, or "-" when there is no B.
  ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b + 0 > 0) printf "%.2f", a / b; else print "-" }'; }
  naive=naive-${label##*-}
  naive_rps=$(awk -v l="$naive" '$1 == l {print $2}' "$work/results" | median)
  naive_redis=$(awk -v l="$naive" '$1 == l {print $4}' "$work/results" | median)
  printf '%-16s %10s %8s %8sus %14s %14s %12s %10s %10s\n' "$label" "$rps" "$(ratio "$rps" "$bare_rps")" \
    "$p50" "$server_us" "$redis_us" "$wrk_us" "$(ratio "$rps" "$naive_rps")" "$(ratio "$redis_us" "$naive_redis")"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$label" "$rps" "$(ratio "$rps" "$bare_rps")" "$p50" \
    "$server_us" "$redis_us" "$wrk_us" "$(ratio "$rps" "$naive_rps")" >>"$medians"
done
echo "medians: $medians"

