# Whether each figure of a soak run's samples (benches/soak.sh's TSV) stays flat over the last
# half of the run, after the first half's warm-up: the line through the last half's samples must
# rise by at most 5 % of their median over that half. The line's slope is Theil-Sen's, the median
# of the slopes between every two samples, so one stalled sample (a latency spike of the shared
# 2-core machine, 10x the others) can't tilt it, while a steady climb does. The least-squares
# slope is printed beside it, for comparison. Exits 1 if any figure grows.
#
#   awk -v store=redis -f benches/soak_flat.awk benches/soak/redis.tsv
BEGIN { FS = "\t"; split("rss_kb fds redis_used_kb redis_keys p50_us p99_us", names, " ") }
NR > 1 { n++; t[n] = $1; for (i = 2; i <= 7; i++) v[n, i] = $i }

# median(a, count): the median of a[1..count] (sorts a in place).
function median(a, count,    x, y, tmp) {
  for (x = 2; x <= count; x++) {
    tmp = a[x]
    for (y = x - 1; y >= 1 && a[y] > tmp; y--) a[y + 1] = a[y]
    a[y + 1] = tmp
  }
  return count % 2 ? a[(count + 1) / 2] : (a[count / 2] + a[count / 2 + 1]) / 2
}

END {
  first = int(n / 2) + 1
  bad = 0
  for (i = 2; i <= 7; i++) {
    m = 0; st = 0; sv = 0; stt = 0; stv = 0; pairs = 0
    delete values; delete slopes
    for (k = first; k <= n; k++) {
      m++; values[m] = v[k, i]
      st += t[k]; sv += v[k, i]; stt += t[k] * t[k]; stv += t[k] * v[k, i]
      for (j = first; j < k; j++) slopes[++pairs] = (v[k, i] - v[j, i]) / (t[k] - t[j])
    }
    level = median(values, m)
    if (level == 0) continue
    span = t[n] - t[first]
    rise = median(slopes, pairs) * span / level * 100
    if (m < 2) { print store " " names[i - 1] ": one sample in the last half, no trend"; bad = 1; continue }
    least_squares = (m * stv - st * sv) / (m * stt - st * st) * span / (sv / m) * 100
    verdict = rise <= 5 ? "flat" : "GROWS"
    if (rise > 5) bad = 1
    printf "%s %s: median %.0f over the last half, trend %+.1f %% over it (least squares %+.1f %%): %s\n", \
      store, names[i - 1], level, rise, least_squares, verdict
  }
  exit bad
}
