#!/bin/sh
# One preset: verify (unless VERIFY=0) then compare, one at a time, niced; waits while the machine
# lacks the RAM. usage: run.sh BIN PRESET RES NEED_GIB ATTENTION [extra flags…]
# Variants: every precision × {none, all} recompute × the given (the preset's default) attention.
set -u
BIN=$1; P=$2; R=$3; NEED=$4; A=$5; shift 5
cd "$(dirname "$0")"
V=""
for p in fp64 fp32 bf16-mixed fp16-mixed bf16-pure; do
  for r in none all; do V="$V${V:+,}$p/$r/$A"; done
done
wait_ram() {
  while [ "$(free -g | awk '/^Mem:/ {print $7}')" -lt "$1" ]; do
    echo "$(date -u +%T) $P waiting: available $(free -g | awk '/^Mem:/ {print $7}') GiB < $1 GiB" >> load.log
    sleep 20
  done
}
if [ "${VERIFY:-1}" = 1 ]; then
  wait_ram "$NEED"
  echo "$(date -u +%T) $P verify start; load $(cut -d' ' -f1-3 /proc/loadavg); available $(free -m | awk '/^Mem:/ {print $7}') MiB" >> load.log
  nice -n ${NICE:-15} /usr/bin/time -v "$BIN" verify --preset "$P" --depth 1 --resolution "$R" --batch 1 --steps 1 \
      --variants "$V" --jobs 1 --json "$@" > "verify-$P-d1-r$R.json" 2> "verify-$P-d1-r$R.time"
  echo "$(date -u +%T) $P verify rc $?; load $(cut -d' ' -f1-3 /proc/loadavg)" >> load.log
fi
wait_ram 4
nice -n ${NICE:-15} /usr/bin/time -v "$BIN" compare --preset "$P" --depth 1 --resolution "$R" --batch 1 --steps 1 \
    --json "$@" > "compare-$P-d1-r$R.json" 2> "compare-$P-d1-r$R.time"
echo "$(date -u +%T) $P compare rc $?; load $(cut -d' ' -f1-3 /proc/loadavg)" >> load.log
