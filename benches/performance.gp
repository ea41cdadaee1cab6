# The guide's performance chart: req/s of each server as a ratio to bare axum, on the hot key and
# on 10 000 identities (64 connections), from benches/load_peers.sh's medians.
# gnuplot -e "data='benches/peers/medians.tsv'; out='docs/pictures/performance.svg'" benches/performance.gp
set terminal svg size 960,380 dynamic font "sans,11" background "white"
set output out
set datafile separator "\t"
set termoption noenhanced
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set grid ytics
set yrange [0:1.2]
set ylabel "req/s, bare axum = 1"
set key top right
set xtics nomirror font "sans,10"
set xrange [-0.6:*]
set title "Admitted requests per second, 64 connections over loopback, 2 shared cores (ours: tower-redis-ratelimit; t-r-l: tower-rate-limit)"
# One row per server: its hot-key ratio and its 10 000-identities ratio.
rows = "< awk -F'\\t' 'NR > 1 { split($1, p, \"-\"); s = $1; sub(/-(c64|users)$/, \"\", s); \
  if ($1 ~ /-c64$/) hot[s] = $3; else if ($1 ~ /-users$/) users[s] = $3; else next; \
  if (!(s in seen)) { seen[s] = 1; order[++n] = s } } \
  END { name[\"bare\"] = \"bare axum\"; name[\"governor\"] = \"tower_governor\"; \
  name[\"memory\"] = \"ours, memory\"; name[\"naive\"] = \"naive Redis\"; \
  name[\"trl-redis\"] = \"t-r-l-redis\"; name[\"trl-fred\"] = \"t-r-l-fred\"; \
  name[\"redis\"] = \"ours, Redis\"; name[\"redis-prefetch\"] = \"ours, prefetch\"; \
  for (i = 1; i <= n; i++) printf \"%s\\t%s\\t%s\\n\", name[order[i]], hot[order[i]], users[order[i]] }' ".data
plot rows using 2:xtic(1) title "one hot key" lc rgb "#5b7db1", \
     '' using 3 title "10 000 identities" lc rgb "#4a9a63"
