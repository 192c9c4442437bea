#!/bin/bash
# verify at real width, reduced depth: usage verify.sh PRESET DEPTH RES VARIANTS
set -u
BIN=${BIN:-./target/release/ditmem}
OUT=$(dirname "$0")
tag="$1-d$2-r$3"
/usr/bin/time -v -o "$OUT/verify-$tag.time" nice -n 10 $BIN verify --preset "$1" --depth "$2" \
  --resolution "$3" --batch 1 --steps 1 --variants "$4" --jobs 1 --json > "$OUT/verify-$tag.json" 2> "$OUT/verify-$tag.err"
