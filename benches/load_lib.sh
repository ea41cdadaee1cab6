# Shared by the load scripts (sourced, not run): start a server, load it with wrk over loopback,
# and measure the CPU time it and its Redis servers spent per request from /proc/<pid>/stat, which
# is steadier than req/s on a small shared machine.

# require_wrk: fails, saying how to get it, if wrk is missing (measure needs it; the soak doesn't).
require_wrk() {
  command -v wrk >/dev/null || { echo "wrk is missing: apt-get install wrk" >&2; exit 1; }
}

# Clock ticks per second, for /proc/<pid>/stat's utime and stime.
clock_ticks=$(getconf CLK_TCK)

# cpu_ticks PID... : user + system ticks of these processes, summed.
cpu_ticks() {
  local total=0 pid ticks
  for pid in "$@"; do
    # Fields after "pid (comm) ": utime and stime are the 12th and 13th.
    ticks=$(sed 's/^.*) //' "/proc/$pid/stat" | awk '{print $12 + $13}')
    total=$((total + ticks))
  done
  echo "$total"
}

# start_own_redis PORT DIR: a redis-server of the script's own on 127.0.0.1:PORT, without
# persistence, its files and log in DIR, waited for ($! is its pid afterwards); refuses a port
# another Redis answers on.
start_own_redis() {
  local port=$1 dir=$2
  if redis-cli -p "$port" ping >/dev/null 2>&1; then
    echo "port $port is taken by another Redis" >&2; exit 1
  fi
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" \
    >"$dir/redis-$port.log" 2>&1 &
  for _ in $(seq 1 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "redis-server on $port did not start:" >&2; cat "$dir/redis-$port.log" >&2; exit 1
}

# wait_for_http URL: until it answers (at most 5 s).
wait_for_http() {
  for _ in $(seq 1 50); do
    curl -s -o /dev/null "$1" && return 0
    sleep 0.1
  done
  echo "$1 did not answer within 5 s" >&2
  return 1
}

# measure LABEL URL SECONDS CONNECTIONS SERVER_PID [REDIS_PID...]
#   Loads URL with wrk (one thread; $WRK_SCRIPT, if set, is its Lua script) and prints
#   "LABEL req/s p50 p99 server-µs/request redis-µs/request wrk-µs/request". wrk's own CPU shows
#   what is left of the two cores for the server and Redis. Any non-2xx answer is an error:
#   the runs measure admissions, so a refusal means a limit was set too low; with ALLOW_REFUSED
#   set (a rejection flood), it is the other way round: a run without refusals is an error.
measure() {
  local label=$1 url=$2 seconds=$3 connections=$4 server=$5
  shift 5
  local out script_args=()
  out=$(mktemp)
  [[ -n "${WRK_SCRIPT:-}" ]] && script_args=(-s "$WRK_SCRIPT")
  local server_before redis_before=0
  server_before=$(cpu_ticks "$server")
  (($# > 0)) && redis_before=$(cpu_ticks "$@")
  local wrk_cpu
  # bash's `time` reports wrk's user and system seconds on stderr, in TIMEFORMAT.
  wrk_cpu=$({ TIMEFORMAT='%U %S'; time wrk -t1 -c"$connections" -d"${seconds}s" --latency \
    "${script_args[@]}" "$url" >"$out"; } 2>&1 | awk '{print $1 + $2}')
  local server_after redis_after=0
  server_after=$(cpu_ticks "$server")
  (($# > 0)) && redis_after=$(cpu_ticks "$@")
  local refusals_ok=${ALLOW_REFUSED:-}
  if grep -q "Socket errors" "$out" || { [[ -z $refusals_ok ]] && grep -q "Non-2xx" "$out"; } \
    || { [[ -n $refusals_ok ]] && ! grep -q "Non-2xx" "$out"; }; then
    echo "$label: some requests failed, or were refused (or, in a flood, none were):" >&2
    cat "$out" >&2
    rm -f "$out"
    return 1
  fi
  local requests rps p50 p99
  requests=$(awk '/requests in/ {print $1}' "$out")
  rps=$(awk '/^Requests\/sec/ {print $2}' "$out")
  p50=$(awk '$1 == "50%" {print $2}' "$out")
  p99=$(awk '$1 == "99%" {print $2}' "$out")
  rm -f "$out"
  awk -v l="$label" -v rps="$rps" -v p50="$p50" -v p99="$p99" -v n="$requests" -v hz="$clock_ticks" \
    -v s="$((server_after - server_before))" -v r="$((redis_after - redis_before))" -v w="$wrk_cpu" \
    'BEGIN { printf "%s %s %s %s %.1f %.1f %.1f\n", l, rps, p50, p99, s * 1e6 / hz / n, r * 1e6 / hz / n, w * 1e6 / n }'
}

# median: the median of the numbers on stdin.
median() {
  sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
