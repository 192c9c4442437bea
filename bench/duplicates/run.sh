#!/usr/bin/env bash
# The `duplicates` count of this checkout, sorted by kind (README.md). Needs the tool library's
# `duplicates` command on PATH (it is not part of the repository).
# usage: bench/duplicates/run.sh [OUT]   (default runs/<date>-<cpu>-<rev>/)
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v duplicates >/dev/null || { echo "run.sh: the duplicates command is not on PATH" >&2; exit 5; }
rev=$(git rev-parse --short HEAD)
out=${1:-bench/duplicates/runs/$(bench/run_label.sh)}
mkdir -p "$out/lists"
duplicates --most 200 --seconds 120 > "$out/lists/tree.txt"
for d in crates/budget crates/engine crates/cli crates/conformance crates/spec crates bench python; do
  duplicates --repo "$d" --most 200 --seconds 120 > "$out/lists/${d//\//_}.txt"
done
{
  echo "rev: $rev ($(git log -1 --format=%s | cut -c1-100))"
  echo "changed beside this run: $(git status --porcelain --untracked-files=all | { grep -vF -- "${out%/}/" || true; } | wc -l) paths"
  echo "date: $(date -u +%FT%TZ)"
  echo "tree: $(head -1 "$out/lists/tree.txt")"
} > "$out/conditions.txt"
python3 bench/duplicates/classify.py . "$out" "$out"/lists/*.txt | tee -a "$out/conditions.txt"
