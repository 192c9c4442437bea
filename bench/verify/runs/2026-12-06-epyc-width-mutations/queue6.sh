#!/bin/sh
# After queue5's original DiTs of patch 2: those of patch 4 and 8 (64 and 16 tokens at 256²).
cd "$(dirname "$0")"
until grep -q "dit-l-2 compare rc" load.log; do sleep 15; done
B=/tmp/vwidth-ditmem
for P in dit-s-4 dit-s-8 dit-b-4 dit-b-8 dit-l-4 dit-l-8 dit-xl-4 dit-xl-8; do ./run.sh $B $P 256 2 materialized; done
