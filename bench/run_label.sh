#!/usr/bin/env bash
# The name of a dated run folder, `<date>-<cpu>-<rev>` (bench/*/runs/): today's UTC date, the
# CPU's family as /proc/cpuinfo names it, lower case ("epyc", "xeon", "core"), and the short
# commit of REV (default HEAD). Shared by the run scripts that name their own folders.
#   bench/run_label.sh [REV]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rev="$(git -C "$root" rev-parse --short "${1:-HEAD}")"
cpu="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //; s/^AMD //; s/^Intel(R) //; s/(R)//g; s/ .*//' | tr 'A-Z' 'a-z')"
echo "$(date -u +%Y-%m-%d)-${cpu:-cpu}-$rev"
