#!/usr/bin/env bash
# The GPU kit's one command (bench/gpu/README.md).
#
#   bench/gpu/run.sh            # on a CUDA machine: the grid on the real sizes, results in $OUT
#   bench/gpu/run.sh --cpu      # here: the same recipe kinds on tiny specs on the CPU (≈ 3 min)
#   extra arguments go to gpu_grid.py (--only a,b  --budget-s 420)
#
# GPU: uses the machine's python3 (PyTorch with CUDA, accelerate, peft, transformers installed),
# installs diffusers and bitsandbytes from bench/gpu/wheels/ (fetch_wheels.sh; no network) into a
# venv that sees the system's packages, runs bench/gpu/bin/ditmem (or target/release/ditmem) and
# writes everything under $OUT/gpu-grid (default bench/gpu/out/<date>-<card>/).
# CPU: creates or reuses bench/torch_peer/.venv with the project's setup_diffusers.sh, uses
# target/release/ditmem (built when missing) and writes under $OUT/cpu-grid (default a temporary
# folder); exits non-zero when no row was measured or a row's table is missing.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cpu=0
if [ "${1:-}" = "--cpu" ]; then cpu=1; shift; fi
export OMP_WAIT_POLICY=PASSIVE
if [ "$cpu" = 1 ]; then
    py="$root/bench/torch_peer/.venv/bin/python"
    if ! "$py" -c 'import diffusers, peft' 2>/dev/null; then
        "$root/bench/torch_peer/setup_diffusers.sh" >&2
    fi
    ditmem="$root/target/release/ditmem"
    if [ ! -x "$ditmem" ]; then
        (cd "$root" && cargo build --release -p ditmem >&2)
    fi
    out="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/ditmem-gpu-kit-cpu.XXXXXX")}/cpu-grid"
    "$py" "$here/gpu_grid.py" --cpu --out "$out" --ditmem "$ditmem" "$@"
    test -s "$out/table.md" && test -s "$out/results.json"
    echo "run.sh --cpu: table and results in $out"
    exit 0
fi
sys_py="${PYTHON:-python3}"
venv="${TMPDIR:-/tmp}/ditmem-gpu-venv"
if [ ! -x "$venv/bin/python" ]; then
    "$sys_py" -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"
if ! "$py" -c 'import diffusers, bitsandbytes' 2>/dev/null; then
    "$py" -m pip install -q --no-index --find-links "$here/wheels" "diffusers==${DIFFUSERS_VERSION:-0.42.1}" >&2 \
        || { echo "run.sh: diffusers did not install from $here/wheels (run fetch_wheels.sh where there is network)" >&2; exit 5; }
    "$py" -m pip install -q --no-index --find-links "$here/wheels" bitsandbytes >&2 \
        || echo "run.sh: bitsandbytes did not install: its rows (8-bit AdamW, NF4) will say so" >&2
fi
ditmem="$here/bin/ditmem"
[ -x "$ditmem" ] || ditmem="$root/target/release/ditmem"
[ -x "$ditmem" ] || { echo "run.sh: no ditmem binary (bench/gpu/bin/ditmem from fetch_wheels.sh)" >&2; exit 5; }
card="$("$py" -c 'import torch; print(torch.cuda.get_device_name(0).replace(" ", "_"))')"
out="${OUT:-$here/out/$(date -u +%Y-%m-%d)-$card}/gpu-grid"
mkdir -p "$out"
{
    nvidia-smi || true
    "$py" -c 'import torch, diffusers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda, "diffusers", diffusers.__version__, "peft", peft.__version__)'
    "$py" -c 'import bitsandbytes; print("bitsandbytes", bitsandbytes.__version__)' 2>&1 | tail -1
    "$ditmem" --version
    nproc; free -g | head -2
} > "$out/machine.txt" 2>&1
"$py" "$here/gpu_grid.py" --out "$out" --ditmem "$ditmem" "$@"
echo "run.sh: table and results in $out"
