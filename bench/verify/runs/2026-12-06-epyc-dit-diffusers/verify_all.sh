#!/bin/bash
# The verify table of the README, in order (each row: verify.sh PRESET DEPTH RES VARIANTS).
D=$(dirname "$0")
SIX='fp32/none/*,bf16-mixed/none/*,fp16-mixed/none/memory-efficient,bf16-mixed/all/memory-efficient'
$D/verify.sh dit-xl-2-256 1 256 '*/*/*'
$D/verify.sh dit-xl-2-256 2 256 '*/*/*'
$D/verify.sh dit-xl-2-512 1 512 "$SIX"
$D/verify.sh dit-xl-2-512 2 512 "$SIX"
