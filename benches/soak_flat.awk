# Whether each figure of a soak run's samples (benches/soak.sh's TSV) stays flat over the last
# half of the run, after the first half's warm-up: the line through the last half's samples must
# rise by at most 5 % of their median over that half. The line's slope is Theil-Sen's, the median
# of the slopes between every two samples, so one stalled sample (a latency spike of the shared
# 2-core machine, 10x the others) can't tilt it, while a steady climb does. The least-squares
# slope is printed beside it, for comparison. Latency is judged as the aged server's over the young
# control's (p50_over_young, p99_over_young), which cancels the host's drift; the raw p50/p99
# trends are printed, not judged. Latency is judged only if the servers' core had headroom (its
# median busy share over the last half at most 75 %): nearer saturation a queue's wait swings with
# the machine's noise, and the run says so and fails. Exits 1 if any figure grows.
#
#   awk -v store=redis -f benches/soak_flat.awk benches/soak/redis.tsv
BEGIN {
  FS = "\t"
  judged = "rss_kb fds redis_used_kb redis_keys p50_over_young p99_over_young"
  # Printed, not judged: they move with the host's speed (by a quarter over minutes on the 2-core
  # VM, for the same work), which the ratios above cancel.
  shown = "p50_us p99_us app_cpu_us redis_cpu_us checks_per_call"
  max_busy = 75
}
NR == 1 { for (i = 1; i <= NF; i++) column[$i] = i; next }
{ n++; t[n] = $1; for (i = 2; i <= NF; i++) v[n, i] = $i }

# median(a, count): the median of a[1..count] (sorts a in place).
function median(a, count,    x, y, tmp) {
  for (x = 2; x <= count; x++) {
    tmp = a[x]
    for (y = x - 1; y >= 1 && a[y] > tmp; y--) a[y + 1] = a[y]
    a[y + 1] = tmp
  }
  return count % 2 ? a[(count + 1) / 2] : (a[count / 2] + a[count / 2 + 1]) / 2
}

# last_half_median(i): the median of column i over the last half's samples.
function last_half_median(i,    k, m, values) {
  for (k = first; k <= n; k++) values[++m] = v[k, i]
  return median(values, m)
}

END {
  first = int(n / 2) + 1
  if (n - first + 1 < 2) { print store ": one sample in the last half, no trend"; exit 1 }
  bad = 0
  busy = "core0_busy_pct" in column ? last_half_median(column["core0_busy_pct"]) : 0
  if ("core0_busy_pct" in column)
    printf "%s core0_busy_pct: median %.0f over the last half (at most %d to judge latency)\n", store, busy, max_busy
  count = split(judged " " shown, names, " ")
  judged_count = split(judged, unused, " ")
  for (name_index = 1; name_index <= count; name_index++) {
    name = names[name_index]
    is_judged = name_index <= judged_count
    if (!(name in column)) continue
    i = column[name]
    if (is_judged && name ~ /^p[0-9]+_/ && busy > max_busy) {
      printf "%s %s: NOT JUDGED, the server's core was %.0f %% busy: the latency measures a saturated queue; lower the rate\n", store, name, busy
      bad = 1
      continue
    }
    m = 0; st = 0; sv = 0; stt = 0; stv = 0; pairs = 0
    delete slopes
    for (k = first; k <= n; k++) {
      m++
      st += t[k]; sv += v[k, i]; stt += t[k] * t[k]; stv += t[k] * v[k, i]
      for (j = first; j < k; j++) slopes[++pairs] = (v[k, i] - v[j, i]) / (t[k] - t[j])
    }
    level = last_half_median(i)
    if (level == 0) continue
    span = t[n] - t[first]
    rise = median(slopes, pairs) * span / level * 100
    least_squares = (m * stv - st * sv) / (m * stt - st * st) * span / (sv / m) * 100
    verdict = !is_judged ? "shown, not judged" : rise <= 5 ? "flat" : "GROWS"
    if (is_judged && rise > 5) bad = 1
    printf "%s %s: median %.6g over the last half, trend %+.1f %% over it (least squares %+.1f %%): %s\n", \
      store, name, level, rise, least_squares, verdict
  }
  exit bad
}
