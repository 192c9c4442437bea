#!/usr/bin/env bash
# Creates bench/ecosystem/.venv with the libraries whose loaders check.py holds ditmem's exports
# against. Pinned: the versions the checks were written for (issue 17). DeepSpeed installs from
# its sdist without building ops (DS_BUILD_OPS=0: only its config and launcher are used); it needs
# torch, which PyPI ships with CUDA libraries (~3 GB, no CPU-only wheel there; pip's cache makes
# a second install quick). No GPU is used. Never needed by `cargo test --release --workspace`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
if [ ! -x "$here/.venv/bin/python" ]; then
    "$python" -m venv "$here/.venv"
fi
"$here/.venv/bin/python" -m pip install -q --upgrade pip
"$here/.venv/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.15.0}"
DS_BUILD_OPS=0 "$here/.venv/bin/python" -m pip install -q \
    "accelerate==${ACCELERATE_VERSION:-1.16.0}" "deepspeed==0.19.8" "diffusers==0.42.1"
# For end_to_end.py (the diffusers scripts run on tiny local pipelines): the scripts import
# torchvision (transforms) and transformers (text encoders, tokenizers), and train LoRA with peft.
# torchvision 0.29.2 is the newest on PyPI and asks for torch >= 2.14.
"$here/.venv/bin/python" -m pip install -q "transformers==5.25.0" "peft==0.21.2" "torchvision==0.29.2"
"$here/.venv/bin/python" -c 'import accelerate, deepspeed, diffusers, peft, torch, torchvision, transformers; print("accelerate", accelerate.__version__, "deepspeed", deepspeed.__version__, "diffusers", diffusers.__version__, "torch", torch.__version__, "torchvision", torchvision.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
