#!/bin/sh
# compare alone: the presets whose verify would pass ~8 GiB (FLUX.1, Wan 14B: their 3-variant
# verify is in ../2026-12-06-epyc-real-width-all) and the original DiTs of patch 4 and 8.
cd "$(dirname "$0")"
B=/tmp/vwidth-ditmem
for P in flux.1-dev flux.1-schnell; do VERIFY=0 ./run.sh $B $P 64 0 - --text-tokens 77,16; done
VERIFY=0 ./run.sh $B wan2.1-14b 64 0 - --frames 1 --text-tokens 16
for P in dit-s-4 dit-s-8 dit-b-4 dit-b-8 dit-l-4 dit-l-8 dit-xl-4 dit-xl-8; do VERIFY=0 ./run.sh $B $P 256 0 -; done
