#!/usr/bin/env bash
# Loopback load run of the demo server: the same routes with no limiter, with the in-memory store and
# with the Redis store, measured in the same run, alternating, with wrk. Prints requests per second,
# p50/p99 latency and the ratio of each limited run to the no-limiter run of the same round.
#
#   bash benches/load.sh [seconds per run, default 10] [rounds, default 2]
#
# Needs wrk (`apt-get install wrk`) and a Redis: REDIS_URL, default redis://127.0.0.1:6379/0 (the Redis
# runs fail closed, so a missing Redis shows as errors, not as fast fail-open answers). Only
# loopback is targeted. Limits are set far above what a run
# can reach, so every request is admitted: this measures the cost of the layer, not of refusals. The
# period is one second so the sliding log holds one second of admissions, not minutes of them.
set -euo pipefail
cd "$(dirname "$0")/.."

duration=${1:-10}
rounds=${2:-2}
connections=64
threads=2
port_base=38080

command -v wrk >/dev/null || { echo "wrk is missing: apt-get install wrk" >&2; exit 1; }
cargo build --release --example demo --all-features -q
demo=target/release/examples/demo

work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

redis_url=${REDIS_URL:-redis://127.0.0.1:6379/0}

config() { # $1 port, $2 algorithm, $3 store (default memory)
  cat <<TOML
listen = "127.0.0.1:$1"
store = "${3:-memory}"
on_store_error = "deny"
prefix = "load-$$"
trusted_proxies = []
legacy_headers = false

[[routes]]
path = "/api/ping"
key = "ip"
algorithm = "$2"
rules = [{ limit = 1000000000, period = "1s" }]
TOML
}

# One run: $1 label, then demo arguments. Prints "label rps p50 p99".
run() {
  local label=$1 port=$2; shift 2
  RUST_LOG=warn "$demo" "$@" >/dev/null 2>"$work/$label.log" &
  local pid=$!
  for _ in $(seq 1 50); do
    curl -s -o /dev/null "http://127.0.0.1:$port/healthz" && break
    sleep 0.1
  done
  wrk -t"$threads" -c"$connections" -d"${duration}s" --latency "http://127.0.0.1:$port/api/ping" >"$work/$label.wrk"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  local rps p50 p99
  rps=$(awk '/^Requests\/sec/ {print $2}' "$work/$label.wrk")
  p50=$(awk '$1 == "50%" {print $2}' "$work/$label.wrk")
  p99=$(awk '$1 == "99%" {print $2}' "$work/$label.wrk")
  if grep -q "Non-2xx" "$work/$label.wrk"; then
    echo "$label: some responses were not 2xx; the limits are too low for this run" >&2
    exit 1
  fi
  echo "$label $rps $p50 $p99"
}

printf '%-6s %-22s %12s %9s %9s %9s\n' round setup "req/s" p50 p99 "ratio"
for round in $(seq 1 "$rounds"); do
  config "$port_base" sliding_log >"$work/baseline.toml"
  config $((port_base + 1)) sliding_log >"$work/sliding.toml"
  config $((port_base + 2)) fixed_window >"$work/fixed.toml"
  config $((port_base + 3)) fixed_window "$redis_url" >"$work/redis.toml"
  read -r _ base_rps base_p50 base_p99 < <(run baseline "$port_base" --config "$work/baseline.toml" --no-limiter)
  printf '%-6s %-22s %12s %9s %9s %9s\n' "$round" "no limiter" "$base_rps" "$base_p50" "$base_p99" "1.00"
  for setup in "memory sliding_log:$((port_base + 1)):sliding" "memory fixed_window:$((port_base + 2)):fixed" "redis fixed_window:$((port_base + 3)):redis"; do
    IFS=: read -r label port file <<<"$setup"
    read -r _ rps p50 p99 < <(run "${file}" "$port" --config "$work/$file.toml")
    ratio=$(awk -v a="$rps" -v b="$base_rps" 'BEGIN { printf "%.3f", a / b }')
    printf '%-6s %-22s %12s %9s %9s %9s\n' "$round" "$label" "$rps" "$p50" "$p99" "$ratio"
  done
done
