#!/bin/sh
# queue2 split in two at 13:18 (queue2 stopped after sd3.5-medium): the verify presets here, the
# compare-only ones in queue4.sh beside it (each under ~2.3 GiB), to finish within the session.
cd "$(dirname "$0")"
while kill -0 27214 2>/dev/null; do sleep 10; done
B=/tmp/vwidth-ditmem
./run.sh $B sana-1600m 128 5 memory-efficient
./run.sh $B sd3.5-large 128 6 memory-efficient
./run.sh $B dit-xl-2 256 3 materialized
./run.sh $B dit-s-2 256 2 materialized
./run.sh $B dit-b-2 256 2 materialized
./run.sh $B dit-l-2 256 3 materialized
