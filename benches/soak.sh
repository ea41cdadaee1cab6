#!/usr/bin/env bash
# Soak run: steady load over 100 000 identities on the demo server, first on the memory store,
# then on Redis (a server of the script's own), each for [minutes]. The route is keyed by the
# `id` query parameter, which oha draws at random from 00000 to 99999 for each request, with a
# sliding log of 1 000 a minute: every request admitted, and every identity's log holding its
# last minute (about 6 entries each at 10 000 requests a second).
#
#   bash benches/soak.sh [minutes per store, default 10] [seconds per sample, default 30] [requests a second, default 10000]
#
# The load comes at a fixed rate, below what either store saturates at on 2 cores, with oha's
# latency correction (a request's latency counts from when it was due, not when it was sent):
# a closed loop like wrk's keeps the cores saturated, so its latency tracks the CPU share of the
# moment rather than the server. Every sample (one oha run of that many seconds, back to back)
# records the app's RSS and open file descriptors, Redis's used_memory and key count, and the
# sample's p50/p99 latency, into benches/soak/<store>.tsv. Then benches/soak_flat.awk checks that
# each figure stays flat over the last half of the run (after the first half's warm-up): Theil-Sen's
# line through those samples rises at most 5 % of their median. The run fails if any grows more.
# benches/soak.gp plots both files into benches/soak/soak.svg. A benchmark: not in CI. Needs oha (`cargo install oha`), gnuplot, redis-server and redis-cli; only loopback is
# targeted.
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/load_lib.sh

minutes=${1:-10}
interval=${2:-30}
rate=${3:-10000}
connections=64
command -v oha >/dev/null || { echo "oha is missing: cargo install oha" >&2; exit 1; }
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
# The server side (the app and its Redis) on core 0, the load on core 1: the app's latency is then
# its own, not the share of a core it wins from the load generator at the moment.
taskset -apc 0 "$!" >/dev/null

# info FIELD: a field of Redis's INFO.
info() { redis-cli -p "$redis_port" info memory | tr -d '\r' | awk -F: -v f="$1" '$1 == f {print $2}'; }
# oha_field EXPRESSION: a figure of the last sample's JSON report (Python's json).
oha_field() { python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print($1)" "$work/oha.json"; }

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
key = "query:id"
algorithm = "sliding_log"
rules = [{ limit = 1000, period = "1m" }]
TOML
  RUST_LOG=warn taskset -c 0 "$demo" --config "$work/$store.toml" >/dev/null 2>"$work/$store.log" &
  pid=$!
  wait_for_http "http://127.0.0.1:$port/healthz"
  tsv=$out/$store.tsv
  printf 'seconds\trss_kb\tfds\tredis_used_kb\tredis_keys\tp50_us\tp99_us\trequests\terrors\n' >"$tsv"
  echo "== $store: $samples samples of ${interval}s at $rate requests a second"
  for sample in $(seq 1 "$samples"); do
    taskset -c 1 oha -q "$rate" -z "${interval}s" -c "$connections" --latency-correction --no-tui -w \
      --output-format json --rand-regex-url "http://127.0.0.1:$port/api/ping\\?id=[0-9]{5}" \
      >"$work/oha.json"
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status")
    fds=$(find "/proc/$pid/fd" -mindepth 1 -maxdepth 1 | wc -l)
    used=0 keys=0
    if [[ $store == redis ]]; then
      used=$(($(info used_memory) / 1024))
      keys=$(redis-cli -p "$redis_port" dbsize)
    fi
    p50=$(oha_field 'round(d["latencyPercentiles"]["p50"] * 1e6)')
    p99=$(oha_field 'round(d["latencyPercentiles"]["p99"] * 1e6)')
    requests=$(oha_field 'sum(d["statusCodeDistribution"].values()) + sum(d["errorDistribution"].values())')
    errors=$(oha_field 'sum(d["errorDistribution"].values()) + sum(n for code, n in d["statusCodeDistribution"].items() if code != "200")')
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
