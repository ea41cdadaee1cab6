# Plots benches/soak.sh's samples (dir/memory.tsv, dir/redis.tsv) into dir/soak.svg: the app's
# RSS, Redis's used_memory and keys, open file descriptors, and p50/p99 latency, over time.
# gnuplot -e "dir='benches/soak'" benches/soak.gp
set terminal svg size 960,720 dynamic font "sans,11"
set output dir.'/soak.svg'
set datafile separator "\t"
set termoption noenhanced
set key top left
set grid
set xlabel "minutes"
set multiplot layout 2,2 title "Soak: 10 000 requests a second over 100 000 identities, sliding log 1 000/min, demo server"
m = dir.'/memory.tsv'
r = dir.'/redis.tsv'

set title "app RSS (MB)"
set yrange [0:*]
plot m using ($1/60):($2/1024) skip 1 with linespoints title "memory store", \
     r using ($1/60):($2/1024) skip 1 with linespoints title "Redis store"

set title "Redis (Redis store's run)"
set ylabel "used_memory (MB)"
set y2label "keys (thousands)"
set y2tics
set y2range [0:*]
plot r using ($1/60):($4/1024) skip 1 with linespoints title "used_memory", \
     r using ($1/60):($5/1000) skip 1 axes x1y2 with linespoints title "keys"
unset y2tics
unset y2label
unset ylabel

set title "open file descriptors (app)"
plot m using ($1/60):3 skip 1 with linespoints title "memory store", \
     r using ($1/60):3 skip 1 with linespoints title "Redis store"

set title "latency per sample (ms)"
plot m using ($1/60):($6/1000) skip 1 with linespoints title "memory p50", \
     m using ($1/60):($7/1000) skip 1 with linespoints title "memory p99", \
     r using ($1/60):($6/1000) skip 1 with linespoints title "Redis p50", \
     r using ($1/60):($7/1000) skip 1 with linespoints title "Redis p99"
unset multiplot
