#!/bin/bash
# compare (engine measured vs ditmem-cpu predicted) on the two DiTTransformer2DModel presets at
# real width, reduced depth; one JSON per row (`compare-<preset>-d<depth>-r<res>-<recipe>.json`).
set -u
BIN=${BIN:-./target/release/ditmem}
OUT=$(dirname "$0")
for pr in "dit-xl-2-256 256" "dit-xl-2-512 512"; do
  set -- $pr; preset=$1; res=$2
  for depth in 1 2; do
    for recipe in "fp32 none" "bf16-mixed none" "bf16-mixed all" "fp16-mixed every-2" "bf16-pure none" "fp32 attention-only"; do
      set -- $recipe; prec=$1; rc=$2
      tag="$preset-d$depth-r$res-$prec-$rc"
      /usr/bin/time -v -o "$OUT/compare-$tag.time" nice -n 10 $BIN compare --preset $preset --depth $depth \
        --resolution $res --batch 1 --precision $prec --recompute $rc --json > "$OUT/compare-$tag.json" 2>&1
    done
    tag="$preset-d$depth-r$res-lora8"
    /usr/bin/time -v -o "$OUT/compare-$tag.time" nice -n 10 $BIN compare --preset $preset --depth $depth \
      --resolution $res --batch 1 --lora-rank 8 --json > "$OUT/compare-$tag.json" 2>&1
  done
done
