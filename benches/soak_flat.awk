# Whether each figure of a soak run's samples (benches/soak.sh's TSV) stays flat over the last
# half of the run, after the first half's warm-up: the least-squares line through the last half's
# samples must rise by at most 5 % of its mean over that half. (A line, not two end points: one
# sample's p99 moves ±8 % from the next on two shared cores.) Exits 1 if any figure grows.
#
#   awk -v store=redis -f benches/soak_flat.awk benches/soak/redis.tsv
BEGIN { FS = "\t"; split("rss_kb fds redis_used_kb redis_keys p50_us p99_us", names, " ") }
NR > 1 { n++; t[n] = $1; for (i = 2; i <= 7; i++) v[n, i] = $i }
END {
  first = int(n / 2) + 1
  bad = 0
  for (i = 2; i <= 7; i++) {
    m = 0; st = 0; sv = 0; stt = 0; stv = 0
    for (k = first; k <= n; k++) { m++; st += t[k]; sv += v[k, i]; stt += t[k] * t[k]; stv += t[k] * v[k, i] }
    mean = sv / m
    if (mean == 0) continue
    slope = (m * stv - st * sv) / (m * stt - st * st)
    rise = slope * (t[n] - t[first]) / mean * 100
    verdict = rise <= 5 ? "flat" : "GROWS"
    if (rise > 5) bad = 1
    printf "%s %s: mean %.0f over the last half, trend %+.1f %% over it: %s\n", store, names[i - 1], mean, rise, verdict
  }
  exit bad
}
