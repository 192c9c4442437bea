#!/bin/sh
# After queue1 (stopped after wan2.1-1.3b: the machine's load made 256² too slow for the larger
# presets): the rest at 128² where 256² would take tens of minutes, then compare alone on the
# presets whose verify would pass ~8 GiB (FLUX.1, Wan 14B) and on every original DiT.
cd "$(dirname "$0")"
while kill -0 378 2>/dev/null; do sleep 10; done
B=/tmp/vwidth-ditmem
./run.sh $B pixart-alpha-1024 256 3 memory-efficient
./run.sh $B sd3.5-medium 128 6 memory-efficient
./run.sh $B sana-1600m 128 5 memory-efficient
./run.sh $B sd3.5-large 128 6 memory-efficient
./run.sh $B dit-xl-2 256 3 materialized
./run.sh $B dit-s-2 256 2 materialized
./run.sh $B dit-b-2 256 2 materialized
./run.sh $B dit-l-2 256 3 materialized
for P in flux.1-dev flux.1-schnell; do VERIFY=0 ./run.sh $B $P 64 0 - --text-tokens 77,16; done
VERIFY=0 ./run.sh $B wan2.1-14b 64 0 - --frames 1 --text-tokens 16
for P in dit-s-4 dit-s-8 dit-b-4 dit-b-8 dit-l-4 dit-l-8 dit-xl-4 dit-xl-8; do VERIFY=0 ./run.sh $B $P 256 0 -; done
