#!/bin/sh
# One preset: verify then compare, one at a time, niced; waits while the machine lacks the RAM.
# usage: run.sh BIN PRESET RES NEED_GIB VARIANTS [extra flags…]
set -u
BIN=$1; P=$2; R=$3; NEED=$4; V=$5; shift 5
cd "$(dirname "$0")"
while [ "$(free -g | awk '/^Mem:/ {print $7}')" -lt "$NEED" ]; do
    echo "$(date -u +%T) waiting: available $(free -g | awk '/^Mem:/ {print $7}') GiB < $NEED GiB" >&2
    sleep 20
done
echo "$(date -u +%T) $P start; load $(cut -d' ' -f1-3 /proc/loadavg); available $(free -m | awk '/^Mem:/ {print $7}') MiB" >> load.log
nice -n ${NICE:-15} /usr/bin/time -v "$BIN" verify --preset "$P" --depth 1 --resolution "$R" --batch 1 --steps 1 \
    --variants "$V" --jobs 1 --json "$@" > "verify-$P-d1-r$R.json" 2> "verify-$P-d1-r$R.time"
echo "$(date -u +%T) $P verify rc $?; load $(cut -d' ' -f1-3 /proc/loadavg)" >> load.log
nice -n ${NICE:-15} /usr/bin/time -v "$BIN" compare --preset "$P" --depth 1 --resolution "$R" --batch 1 --steps 1 \
    --json "$@" > "compare-$P-d1-r$R.json" 2> "compare-$P-d1-r$R.time"
echo "$(date -u +%T) $P compare rc $?; load $(cut -d' ' -f1-3 /proc/loadavg)" >> load.log
