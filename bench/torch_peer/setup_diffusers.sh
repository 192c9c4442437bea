#!/usr/bin/env bash
# Installs a pinned diffusers beside torch into bench/torch_peer/.venv (creating it with
# setup.sh first when it is missing). The transformer classes need neither transformers nor
# accelerate: count_params.py builds them on the meta device with plain torch. peft (pinned) is
# for the LoRA specs of family_peer.py.
# Never needed by `cargo test --release --workspace`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ ! -x "$here/.venv/bin/python" ] || ! "$here/.venv/bin/python" -c 'import torch' 2>/dev/null; then
    "$here/setup.sh"
fi
# Their dependencies pinned by constraints.txt; DIFFUSERS_VERSION / PEFT_VERSION try other
# versions, and then the constraints do not apply.
pins=(-c "$here/constraints.txt")
if [ -n "${DIFFUSERS_VERSION:-}${PEFT_VERSION:-}" ]; then pins=(); fi
# The version the parameter tables in crates/budget/tests/data/ were produced with.
"$here/.venv/bin/python" -m pip install "${pins[@]}" "diffusers==${DIFFUSERS_VERSION:-0.42.1}"
# LoRA of family_peer.py (transformer.add_adapter needs peft; it brings transformers and
# accelerate as its own dependencies, which the peer does not use).
"$here/.venv/bin/python" -m pip install "${pins[@]}" "peft==${PEFT_VERSION:-0.21.2}"
"$here/.venv/bin/python" -c 'import diffusers, peft, torch; print("diffusers", diffusers.__version__, "peft", peft.__version__, "torch", torch.__version__)'
