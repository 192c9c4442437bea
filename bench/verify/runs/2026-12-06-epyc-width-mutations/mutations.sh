#!/bin/sh
# The mutation suite at real width (issue 51), then on the tiny specs, one run at a time, niced.
# Binary: the test target of `cargo test --release -p ditmem-conformance --test verify_mutations`
# at the commit named in README.md.
set -u
cd "$(dirname "$0")"
ROOT=../../../..
BIN=$(ls -t $ROOT/target/release/deps/verify_mutations-* | grep -v '\.d$' | head -1)
echo "$(date -u +%T) binary $BIN" >> load.log
one() { # LABEL TEST [env…]
  L=$1; T=$2; shift 2
  echo "$(date -u +%T) mutations $L start; load $(cut -d' ' -f1-3 /proc/loadavg)" >> load.log
  env "$@" nice -n 15 /usr/bin/time -v "$BIN" "$T" --exact --nocapture > "mutations-$L.txt" 2>&1
  echo "$(date -u +%T) mutations $L rc $?; load $(cut -d' ' -f1-3 /proc/loadavg)" >> load.log
}
one pixart-sigma-1024-d1-r128 every_mutation_that_applies_fails_on_each_family \
    VERIFY_MUTATION_PRESETS=pixart-sigma-1024 VERIFY_MUTATION_RESOLUTION=128
one sana-600m-d1-r256-gain128 every_mutation_that_applies_fails_on_each_family \
    VERIFY_MUTATION_PRESETS=sana-600m VERIFY_MUTATION_RESOLUTION=256 VERIFY_MUTATION_SOFTMAX_GAIN=128
one tiny-families every_mutation_that_applies_fails_on_each_family
one tiny-dit every_mutation_fails_and_correct_variants_pass
