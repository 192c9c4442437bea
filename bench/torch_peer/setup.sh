#!/usr/bin/env bash
# Creates bench/torch_peer/.venv and installs PyTorch from PyPI into it.
# PyPI has no CPU-only torch wheel: this brings ~3 GB of CUDA libraries (about two minutes);
# the result runs fine on CPU. `pip install --no-deps torch` does NOT work (import fails).
# Never needed by `cargo test --release --workspace`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
if [ ! -x "$here/.venv/bin/python" ]; then
    "$python" -m venv "$here/.venv"
fi
"$here/.venv/bin/python" -m pip install --upgrade pip >/dev/null
# Every package pinned by constraints.txt (the venv the runs since 2026-12 were measured with);
# TORCH_VERSION / NUMPY_VERSION try other versions, and then the constraints do not apply.
pins=(-c "$here/constraints.txt")
if [ -n "${TORCH_VERSION:-}${NUMPY_VERSION:-}" ]; then pins=(); fi
"$here/.venv/bin/python" -m pip install "${pins[@]}" "torch==${TORCH_VERSION:-2.15.0}" "numpy==${NUMPY_VERSION:-2.4.6}"
"$here/.venv/bin/python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
