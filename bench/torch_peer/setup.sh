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
"$here/.venv/bin/python" -m pip install "torch${TORCH_VERSION:+==$TORCH_VERSION}" numpy
"$here/.venv/bin/python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
