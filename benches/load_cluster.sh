#!/usr/bin/env bash
# Loopback load run of the demo server on a Redis Cluster against the same store on one Redis
# node, in the same run, interleaved: one identity (every request on one key, so on one primary)
# and many identities (10 000 API keys, spread over every primary), and both again with
# `wait_for_replicas = 1`; and the one identity on the cluster with `prefetch = 100` and `1000`
# (units of the hot key taken ahead: the hot key's shard sees a take, not a check per request).
# The script starts its own servers: one node with a replica, and a cluster of 3 primaries with a
# replica each, so both setups replicate every write.
#
#   bash benches/load_cluster.sh [seconds per run, default 5] [rounds, default 3] [setups, a regex]
#
# Prints req/s, p50/p99 and the CPU time per request of the demo and of its Redis servers (all of
# them: primaries and replicas) for each run, then the medians over the rounds and the ratio of
# each cluster setup to the single node's, and the script calls (FCALL or EVALSHA) the primaries
# served per request: for one identity, those of its key's shard. Every request is admitted (the limits are far above
# what a run reaches): this measures the cost of the store's path, not of refusals. Needs wrk,
# redis-server and redis-cli; only loopback is targeted.
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/load_lib.sh
require_wrk

seconds=${1:-5}
rounds=${2:-3}
only=${3:-.}
connections=64
demo_port=38180
node_port=41000           # its replica: 41001
cluster_ports=(41010 41011 41012 41013 41014 41015) # buses at +10000, below 65536

cargo build --release --example demo --all-features -q
demo=target/release/examples/demo

work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null; rm -rf "$work"' EXIT

# start_redis PORT [ARGS...]: a redis-server of ours on PORT; refuses a port that answers already.
start_redis() {
  local port=$1; shift
  if redis-cli -p "$port" ping >/dev/null 2>&1; then
    echo "port $port is taken by another Redis" >&2; exit 1
  fi
  mkdir -p "$work/$port"
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$work/$port" \
    --repl-diskless-sync-delay 0 "$@" >"$work/$port/log" 2>&1 &
  echo $! >"$work/$port/pid"
  for _ in $(seq 1 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && return; sleep 0.1; done
  echo "redis-server on $port did not start:" >&2; cat "$work/$port/log" >&2; exit 1
}
pid_of() { cat "$work/$1/pid"; }
wait_for() { # DESCRIPTION COMMAND...: until COMMAND succeeds (at most 30 s)
  local what=$1; shift
  for _ in $(seq 1 300); do "$@" && return; sleep 0.1; done
  echo "timed out waiting for $what" >&2; exit 1
}
linked() { redis-cli -p "$1" info replication | grep -q "master_link_status:up"; }
cluster_ok() { redis-cli -p "$1" cluster info | grep -q "cluster_state:ok"; }

start_redis "$node_port"
start_redis $((node_port + 1)) --replicaof 127.0.0.1 "$node_port"
for port in "${cluster_ports[@]}"; do
  start_redis "$port" --cluster-enabled yes --cluster-config-file "$work/$port/nodes.conf" \
    --cluster-node-timeout 5000
done
redis-cli --cluster create $(printf '127.0.0.1:%s ' "${cluster_ports[@]}") \
  --cluster-replicas 1 --cluster-yes >"$work/cluster-create.log"
wait_for "the single node's replica" linked $((node_port + 1))
for port in "${cluster_ports[@]}"; do wait_for "cluster state ok on $port" cluster_ok "$port"; done
for port in "${cluster_ports[@]}"; do
  if redis-cli -p "$port" info replication | grep -q "role:slave"; then
    wait_for "the replica on $port" linked "$port"
  fi
done
node_pids=("$(pid_of $node_port)" "$(pid_of $((node_port + 1)))")
cluster_primaries=()
for port in "${cluster_ports[@]}"; do
  redis-cli -p "$port" info replication | grep -q "role:master" && cluster_primaries+=("$port")
done
cluster_pids=()
for port in "${cluster_ports[@]}"; do cluster_pids+=("$(pid_of "$port")"); done
cluster_store="{ cluster = [$(printf '"redis://127.0.0.1:%s", ' "${cluster_ports[@]:0:3}")] }"

# Many identities: each request carries one of 10 000 API keys.
cat >"$work/many.lua" <<'LUA'
request = function()
  return wrk.format("GET", "/api/ping", { ["x-api-key"] = "key-" .. math.random(1, 10000) })
end
LUA

config() { # STORE KEY WAIT_FOR_REPLICAS PREFETCH
  cat <<TOML
listen = "127.0.0.1:$demo_port"
store = $1
on_store_error = "deny"
store_timeout = "1s"
$( (($3 > 0)) && echo "wait_for_replicas = $3")
prefix = "load-cluster-$$"
trusted_proxies = []
legacy_headers = false

[[routes]]
path = "/api/ping"
key = "$2"
algorithm = "fixed_window"
rules = [{ limit = 1000000000, period = "1s" }]
$( (($4 > 0)) && echo "prefetch = $4")
TOML
}

# stat_sum FIELD PORT...: the sum of an `INFO stats` counter over these servers.
stat_sum() {
  local field=$1 total=0 port value; shift
  for port in "$@"; do
    value=$(redis-cli -p "$port" info stats | tr -d '\r' | awk -F: -v f="$field" '$1 == f {print $2}')
    total=$((total + value))
  done
  echo "$total"
}

# script_calls PORT...: the script calls (FCALL, EVALSHA) these servers have served.
script_calls() {
  local total=0 port value
  for port in "$@"; do
    value=$(redis-cli -p "$port" info commandstats | tr -d '\r' \
      | awk -F'[:=,]' '$1 == "cmdstat_fcall" || $1 == "cmdstat_evalsha" {n += $3} END {print n + 0}')
    total=$((total + value))
  done
  echo "$total"
}

# setup LABEL STORE KEY WAIT PREFETCH: one run of the demo on it; prints measure's line and the commands
# the primaries processed per read (how well their event loops batch).
setup() {
  local label=$1 store=$2 key=$3 wait=$4 prefetch=$5 pids=() args=() primaries=()
  case $store in
    memory) store='"memory"'; args=(--no-limiter) ;;
    \"*) pids=("${node_pids[@]}"); primaries=("$node_port") ;;
    *) pids=("${cluster_pids[@]}"); primaries=("${cluster_primaries[@]}") ;;
  esac
  config "$store" "$key" "$wait" "$prefetch" >"$work/$label.toml"
  [[ $key == ip ]] && unset WRK_SCRIPT || export WRK_SCRIPT="$work/many.lua"
  RUST_LOG=warn "$demo" --config "$work/$label.toml" "${args[@]}" >/dev/null 2>"$work/$label.log" &
  local demo_pid=$!
  wait_for_http "http://127.0.0.1:$demo_port/healthz"
  local commands=0 reads=0 calls=0 line
  if ((${#primaries[@]} > 0)); then
    commands=$(stat_sum total_commands_processed "${primaries[@]}")
    reads=$(stat_sum total_reads_processed "${primaries[@]}")
    calls=$(script_calls "${primaries[@]}")
  fi
  line=$(measure "$label" "http://127.0.0.1:$demo_port/api/ping" "$seconds" "$connections" "$demo_pid" "${pids[@]}")
  if ((${#primaries[@]} > 0)); then
    commands=$(($(stat_sum total_commands_processed "${primaries[@]}") - commands))
    reads=$(($(stat_sum total_reads_processed "${primaries[@]}") - reads))
    calls=$(($(script_calls "${primaries[@]}") - calls))
  fi
  # Requests: req/s (measure's second field) over the run's seconds.
  echo "$line $(awk -v c="$commands" -v r="$reads" -v s="$calls" -v rps="${line#* }" -v t="$seconds" \
    'BEGIN { split(rps, f, " "); printf "%.1f %.4f", r ? c / r : 0, s / (f[1] * t) }')"
  kill "$demo_pid"; wait "$demo_pid" 2>/dev/null || true
}

node_store="\"redis://127.0.0.1:$node_port/0\""
setups=(
  "no-limiter|memory|ip|0|0"
  "node-one-id|$node_store|ip|0|0"
  "cluster-one-id|$cluster_store|ip|0|0"
  "cluster-one-id-prefetch100|$cluster_store|ip|0|100"
  "cluster-one-id-prefetch1000|$cluster_store|ip|0|1000"
  "node-many-ids|$node_store|header:x-api-key|0|0"
  "cluster-many-ids|$cluster_store|header:x-api-key|0|0"
  "node-many-ids-wait1|$node_store|header:x-api-key|1|0"
  "cluster-many-ids-wait1|$cluster_store|header:x-api-key|1|0"
)
selected=()
for entry in "${setups[@]}"; do
  [[ ${entry%%|*} =~ $only ]] && selected+=("$entry")
done
setups=("${selected[@]}")

printf '%-6s %-27s %10s %9s %9s %12s %12s %10s %10s\n' round setup "req/s" p50 p99 "demo µs/req" "redis µs/req" \
  "cmds/read" "calls/req"
for round in $(seq 1 "$rounds"); do
  # The order rotates each round, so no setup always runs first or last.
  for i in $(seq 0 $((${#setups[@]} - 1))); do
    IFS='|' read -r label store key wait prefetch <<<"${setups[$(((i + round - 1) % ${#setups[@]}))]}"
    read -r _ rps p50 p99 demo_us redis_us _wrk_us per_read calls < <(setup "$label" "$store" "$key" "$wait" "$prefetch") || true
    [[ -n ${calls:-} ]] || { echo "the $label run failed (see above)" >&2; exit 1; }
    printf '%-6s %-27s %10s %9s %9s %12s %12s %10s %10s\n' "$round" "$label" "$rps" "$p50" "$p99" "$demo_us" "$redis_us" "$per_read" "$calls"
    echo "$label $rps $demo_us $redis_us $per_read $calls" >>"$work/results"
  done
done

echo
echo "medians over $rounds rounds; ratio = cluster / node of the same load (per-request CPU: demo + redis)"
printf '%-27s %10s %12s %12s %12s %8s %10s %10s\n' setup "req/s" "demo µs/req" "redis µs/req" "total µs/req" ratio \
  "cmds/read" "calls/req"
for entry in "${setups[@]}"; do
  label=${entry%%|*}
  rps=$(awk -v l="$label" '$1 == l {print $2}' "$work/results" | median)
  demo_us=$(awk -v l="$label" '$1 == l {print $3}' "$work/results" | median)
  redis_us=$(awk -v l="$label" '$1 == l {print $4}' "$work/results" | median)
  per_read=$(awk -v l="$label" '$1 == l {print $5}' "$work/results" | median)
  calls=$(awk -v l="$label" '$1 == l {print $6}' "$work/results" | median)
  total=$(awk -v a="$demo_us" -v b="$redis_us" 'BEGIN { printf "%.1f", a + b }')
  echo "$label $total" >>"$work/totals"
  ratio=""
  if [[ $label == cluster-* ]]; then
    node_total=$(awk -v l="node-${label#cluster-}" '$1 == l {print $2}' "$work/totals")
    [[ -n $node_total ]] && ratio=$(awk -v a="$total" -v b="$node_total" 'BEGIN { printf "%.2fx", a / b }')
  fi
  printf '%-27s %10s %12s %12s %12s %8s %10s %10s\n' "$label" "$rps" "$demo_us" "$redis_us" "$total" "$ratio" \
    "$per_read" "$calls"
done
