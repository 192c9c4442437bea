#!/bin/sh
# 13:25: queue3 split so the session ends in time: SD3.5-large after Sana-1600M (queue3's own
# run), the original DiTs beside them (each < 1.5 GiB).
cd "$(dirname "$0")"
B=/tmp/vwidth-ditmem
( while kill -0 19911 2>/dev/null; do sleep 10; done
  ./run.sh $B sd3.5-large 128 6 memory-efficient ) &
for P in dit-s-2 dit-b-2 dit-xl-2 dit-l-2; do ./run.sh $B $P 256 2 materialized; done
wait
