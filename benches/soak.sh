#!/usr/bin/env bash
# Soak run: steady load over 100 000 rotating identities on the demo server, first on the memory
# store, then on Redis (a server of the script's own), each for [minutes]. The route is keyed by
# `x-user-id` (benches/soak.lua sends identity n % 100 000 for its n-th request), with a sliding
# log of 1 000 a minute: every request admitted, and every identity's log holding its last
# minute (about 12 entries each at 20 000 requests a second).
#
#   bash benches/soak.sh [minutes per store, default 10] [seconds per sample, default 30] [connections, default 16]
#
# Every sample (one wrk run of that many seconds, back to back) records the app's RSS and open
# file descriptors, Redis's used_memory and key count, and the sample's p50/p99 latency, into
# benches/soak/<store>.tsv. Then benches/soak_flat.awk checks that each figure stays flat over
# the last half of the run (after the first half's warm-up): the least-squares line through those
# samples rises at most 5 % of their mean. The run fails if any grows more. benches/soak.gp plots
# both files into benches/soak/soak.svg. A benchmark: not in CI. Needs wrk, gnuplot,
# redis-server and redis-cli; only loopback is targeted.
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/load_lib.sh

minutes=${1:-10}
interval=${2:-30}
connections=${3:-16}
port=38480
redis_port=41500
samples=$((minutes * 60 / interval))
out=benches/soak
mkdir -p "$out"

cargo build --release --example demo --all-features -q
demo=target/release/examples/demo

work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null; rm -rf "$work"' EXIT

start_own_redis "$redis_port" "$work"

# info FIELD: a field of Redis's INFO.
info() { redis-cli -p "$redis_port" info memory | tr -d '\r' | awk -F: -v f="$1" '$1 == f {print $2}'; }
# micros VALUE: wrk's latency (us, ms or s) in microseconds.
micros() { awk -v v="$1" 'BEGIN { n = v + 0; if (v ~ /ms$/) n *= 1000; else if (v ~ /us$/) n *= 1; else if (v ~ /s$/) n *= 1e6; printf "%.0f", n }'; }

failed=0
for store in memory redis; do
  case $store in
    memory) spec='"memory"' ;;
    redis) spec="\"redis://127.0.0.1:$redis_port/0\"" ;;
  esac
  redis-cli -p "$redis_port" flushall >/dev/null
  cat >"$work/$store.toml" <<TOML
listen = "127.0.0.1:$port"
store = $spec
on_store_error = "deny"
prefix = "soak"
trusted_proxies = []

[[routes]]
path = "/api/ping"
key = "header:x-user-id"
algorithm = "sliding_log"
rules = [{ limit = 1000, period = "1m" }]
TOML
  RUST_LOG=warn "$demo" --config "$work/$store.toml" >/dev/null 2>"$work/$store.log" &
  pid=$!
  wait_for_http "http://127.0.0.1:$port/healthz"
  tsv=$out/$store.tsv
  printf 'seconds\trss_kb\tfds\tredis_used_kb\tredis_keys\tp50_us\tp99_us\trequests\terrors\n' >"$tsv"
  echo "== $store: $samples samples of ${interval}s at $connections connections"
  for sample in $(seq 1 "$samples"); do
    wrk -t1 -c"$connections" -d"${interval}s" --latency -s benches/soak.lua \
      "http://127.0.0.1:$port/api/ping" >"$work/wrk" 2>&1
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status")
    fds=$(find "/proc/$pid/fd" -mindepth 1 -maxdepth 1 | wc -l)
    used=0 keys=0
    if [[ $store == redis ]]; then
      used=$(($(info used_memory) / 1024))
      keys=$(redis-cli -p "$redis_port" dbsize)
    fi
    p50=$(micros "$(awk '$1 == "50%" {print $2}' "$work/wrk")")
    p99=$(micros "$(awk '$1 == "99%" {print $2}' "$work/wrk")")
    requests=$(awk '/requests in/ {print $1}' "$work/wrk")
    errors=$(awk '/Non-2xx or 3xx/ {print $5}' "$work/wrk")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' $((sample * interval)) "$rss" "$fds" "$used" "$keys" \
      "$p50" "$p99" "$requests" "${errors:-0}" | tee -a "$tsv"
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true
  awk -v store="$store" -f benches/soak_flat.awk "$tsv" || failed=1
  awk -F'\t' 'NR > 1 { e += $9 } END { if (e > 0) { print e " non-2xx answers"; exit 1 } }' "$tsv" || failed=1
done

gnuplot -e "dir='$out'" benches/soak.gp
echo "plot: $out/soak.svg"
exit "$failed"
