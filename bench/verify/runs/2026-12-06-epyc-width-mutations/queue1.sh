#!/bin/sh
# The cheap presets first (256², as the earlier folders), binary /tmp/vwidth-ditmem (8dcd2a5).
cd "$(dirname "$0")"
B=/tmp/vwidth-ditmem
./run.sh $B pixart-sigma-1024 256 3 memory-efficient
./run.sh $B sana-600m 256 3 memory-efficient
./run.sh $B sd3-medium 256 5 memory-efficient
./run.sh $B wan2.1-1.3b 256 5 memory-efficient --frames 1
./run.sh $B pixart-alpha-1024 256 3 memory-efficient
./run.sh $B dit-xl-2 256 3 materialized
./run.sh $B sd3.5-medium 256 9 memory-efficient
./run.sh $B sd3.5-large 128 6 memory-efficient
./run.sh $B sana-1600m 256 6 memory-efficient
