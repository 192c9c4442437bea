#!/usr/bin/env bash
# The README's test command as CI runs it: a fresh clone of REV (default HEAD), no target/, no
# virtualenvs, an empty pip cache. Writes the whole log and the stage times under OUT.
#
#   bench/ci_time/run.sh [REV] [OUT]     # OUT default: bench/ci_time/runs/<date>-<cpu>-<rev>
#
# What stays warm, and so is not measured: cargo's registry cache (~/.cargo/registry: crates.io
# downloads) and Chromium when the machine has it. Takes 12–20 minutes on a 2-core machine; run
# nothing else beside it.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
rev="$(git -C "$root" rev-parse --short "${1:-HEAD}")"
out="${2:-$here/runs/$("$root/bench/run_label.sh" "$rev")}"
mkdir -p "$out"
work="$(mktemp -d "${TMPDIR:-/tmp}/ditmem-ci-time.XXXXXX")"
trap 'rm -rf "$work"' EXIT
git clone --quiet "$root" "$work/clone"
git -C "$work/clone" checkout --quiet "$rev"
{
    echo "rev: $rev ($(git -C "$root" log -1 --format=%s "$rev" | cut -c1-100))"
    echo "started: $(date -u +%FT%TZ)"
    echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(free -g | awk '/Mem:/{print $2}') GiB"
    echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "rustc: $(rustc --version)"
    echo "python: $(python3 --version 2>&1)"
} > "$out/conditions.txt"
status=0
(cd "$work/clone" && PIP_CACHE_DIR="$work/pip-cache" scripts/test.sh) > "$out/test.log" 2>&1 || status=$?
{
    echo "finished: $(date -u +%FT%TZ), exit $status"
    grep -E '^== .*(ok in|passed in)' "$out/test.log" || true
} >> "$out/conditions.txt"
cat "$out/conditions.txt"
exit "$status"
