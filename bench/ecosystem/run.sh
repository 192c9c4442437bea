#!/usr/bin/env bash
# Generates the exports of a set of plans with the release `ditmem` binary and holds them against
# accelerate, DeepSpeed and the diffusers scripts' parsers (check.py). Needs bench/ecosystem/.venv
# (setup.sh) and `cargo build --release -p ditmem`. Prints the table; writes a run folder runs/<date>-<cpu>-check/ (the
# table, its JSON and the conditions). Never needed by `cargo test --release --workspace`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
ditmem="${DITMEM:-$root/target/release/ditmem}"
py="$here/.venv/bin/python"
[ -x "$ditmem" ] || { echo "build ditmem first: cargo build --release -p ditmem" >&2; exit 5; }
[ -x "$py" ] || { echo "run $here/setup.sh first" >&2; exit 5; }
plans="$here/work/plans"
rm -rf "$plans" && mkdir -p "$plans" "$here/results"

# name | ditmem plan arguments (the family, sharder and offload are export options)
while IFS='|' read -r name args; do
    [ -z "$name" ] && continue
    mkdir -p "$plans/$name"
    # One search, every export of it (the launcher is the accelerate config's: the family's
    # diffusers script, as --emit diffusers); --emit-dir writes the files one launch needs.
    # shellcheck disable=SC2086
    "$ditmem" plan $args --emit accelerate,deepspeed,deepspeed-standalone,diffusers \
        --emit-dir "$plans/$name/files" --json > "$plans/$name/plan.json"
done <<'PLANS'
fp32-1-dit|--precision fp32 --budget 80GiB
bf16-1-flux|--precision bf16-mixed --budget 24GiB --emit-family flux
fp16-1-sd3|--precision fp16-mixed --budget 20GiB --emit-family sd3
lora-1-sana|--lora-rank 16 --budget 24GiB --emit-family sana
lora-needed-1-flux|--budget 9GiB --allow lora,8bit --emit-family flux
ddp-8-sd3|--ranks 8 --batch 256 --budget 40GiB --emit-family sd3
zero1-2-flux-lora|--ranks 2 --batch 64 --zero 1 --lora-rank 32 --budget 40GiB --emit-family flux
zero2-8-sd3|--ranks 8 --batch 256 --zero 2 --budget 40GiB --emit-family sd3
zero3-8-dit|--ranks 8 --batch 256 --budget 8GiB --allow sharding
zero3-8-flux|--ranks 8 --batch 256 --budget 8GiB --allow sharding --emit-family flux
zero2-offload-8-flux|--ranks 8 --batch 256 --zero 2 --budget 40GiB --emit-family flux --emit-offload optimizer
zero3-offload-8-sd3|--ranks 8 --batch 256 --zero 3 --budget 40GiB --emit-family sd3 --emit-offload optimizer+params
fsdp2-8-flux|--ranks 8 --batch 256 --zero 2 --budget 40GiB --emit-family flux --emit-sharder fsdp
fsdp3-offload-8-sd3|--ranks 8 --batch 256 --zero 3 --budget 40GiB --emit-family sd3 --emit-sharder fsdp --emit-offload optimizer+params
lora-targets-1-flux|--preset flux.1-dev --gpu h100-sxm --lora-rank 16 --lora-targets attn.to_q,attn.to_k,attn.to_v,attn.to_out.0
lora-offload-1-sana|--preset sana-600m --gpu rtx-4090 --lora-rank 16 --text-encoders offloaded
lora-1-sd35|--preset sd3.5-medium --gpu rtx-4090 --lora-rank 16
zero2-16-sd35|--preset sd3.5-medium --ranks 16 --batch 64 --zero 2 --budget 80GiB
tokens-1-flux|--preset flux.1-dev --gpu h100-sxm --lora-rank 16 --text-tokens 77,256
PLANS

# One dated folder per run, named by the CPU it ran on, with the command and its conditions.
cpu="$(lscpu 2>/dev/null | sed -n 's/^Model name:[[:space:]]*//p' | head -1)"
tag="$(printf '%s' "${cpu:-cpu}" | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '-' | cut -c1-24 | sed 's/-$//')"
out="$here/runs/$(date -u +%F)-$tag-${LABEL:-check}"
mkdir -p "$out"
printf '# %s: bench/ecosystem/run.sh

- command: `%sbench/ecosystem/run.sh` (ditmem %s)
- CPU: %s
- python packages: see check.md
' \
    "$(date -u +%F)" "${LABEL:+LABEL=$LABEL }" "$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')" "${cpu:-unknown}" > "$out/README.md"
"$py" "$here/check.py" "$plans" --mutants --json "$out/check.json" | tee "$out/check.md"
