# Plots benches/soak.sh's samples (dir/memory.tsv, dir/redis.tsv) into dir/soak.svg: the app's
# RSS, Redis's used_memory and keys, open file descriptors, p50/p99 latency (and the young
# control's), the aged server's latency over the young one's, CPU time per request and how busy
# the servers' core was, over time.
# gnuplot -e "dir='benches/soak'" benches/soak.gp
set terminal svg size 960,1040 dynamic font "sans,11"
set output dir.'/soak.svg'
set datafile separator "\t"
set termoption noenhanced
set key top left
set grid
set xlabel "minutes"
set multiplot layout 3,2 title "Soak: 4 000 requests a second to each of two servers (aged, young) over 100 000 identities, sliding log 1 000/min, demo server"
m = dir.'/memory.tsv'
r = dir.'/redis.tsv'

set title "app RSS (MiB)"
set yrange [0:*]
plot m using ($1/60):($2/1024) skip 1 with linespoints title "memory store", \
     r using ($1/60):($2/1024) skip 1 with linespoints title "Redis store"

set title "Redis (Redis store's run)"
set ylabel "used_memory (MiB)"
set y2label "keys (thousands)"
set y2tics
set y2range [0:*]
plot r using ($1/60):($4/1024) skip 1 with linespoints title "used_memory", \
     r using ($1/60):($5/1000) skip 1 axes x1y2 with linespoints title "keys"
unset y2tics
unset y2label
unset ylabel

set title "open file descriptors (app)"
set key bottom right
plot m using ($1/60):3 skip 1 with linespoints title "memory store", \
     r using ($1/60):3 skip 1 with linespoints title "Redis store"

set title "latency per sample (ms): the aged server, and the young control's p99"
set key top left
plot m using ($1/60):($6/1000) skip 1 with linespoints title "memory p50", \
     m using ($1/60):($7/1000) skip 1 with linespoints title "memory p99", \
     m using ($1/60):($17/1000) skip 1 with lines dashtype 2 title "memory p99, young", \
     r using ($1/60):($6/1000) skip 1 with linespoints title "Redis p50", \
     r using ($1/60):($7/1000) skip 1 with linespoints title "Redis p99", \
     r using ($1/60):($17/1000) skip 1 with lines dashtype 2 title "Redis p99, young"

set title "aged server's latency over the young control's (judged)"
set key bottom right
set yrange [0.5:1.5]
plot m using ($1/60):18 skip 1 with linespoints title "memory p50", \
     m using ($1/60):19 skip 1 with linespoints title "memory p99", \
     r using ($1/60):18 skip 1 with linespoints title "Redis p50", \
     r using ($1/60):19 skip 1 with linespoints title "Redis p99"

set title "CPU time per request (µs), and core 0 busy (%)"
set key bottom right
set yrange [0:*]
set y2tics
set y2range [0:100]
plot m using ($1/60):10 skip 1 with linespoints title "app, memory store", \
     r using ($1/60):10 skip 1 with linespoints title "app, Redis store", \
     r using ($1/60):11 skip 1 with linespoints title "Redis", \
     m using ($1/60):12 skip 1 axes x1y2 with lines dashtype 2 title "core 0 busy, memory run", \
     r using ($1/60):12 skip 1 axes x1y2 with lines dashtype 2 title "core 0 busy, Redis run"
unset multiplot
