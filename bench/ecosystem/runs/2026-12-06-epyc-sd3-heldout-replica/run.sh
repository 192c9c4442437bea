#!/usr/bin/env bash
# The held-out huggingface/diffusers#10120 command, run as published (`python`, no `accelerate
# launch`) with train_dreambooth_sd3.py as it was on 2024-12-04 (commit 76b7d86a, the script's last
# change before that date), on the tiny SD3 pipeline of bench/ecosystem, on the CPU, under the
# e2e memory probe (bench/ecosystem/e2e_hook). Only the sizes differ from the report: tiny model,
# 128² images, 8 of them, --validation_epochs 1 (a validation after every epoch),
# --num_validation_images 1, --max_train_steps 6, bf16 (accelerate 1.16.0 turns no autocast on
# for fp16 on the CPU: accelerator.py:535-548), torch AdamW (no bitsandbytes here).
#
#   bench/ecosystem/setup.sh
#   bench/ecosystem/runs/2026-12-06-epyc-sd3-heldout-replica/run.sh DIFFUSERS_CLONE [WORK]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
eco="$(cd "$here/../.." && pwd)"
py="$eco/.venv/bin/python"
diffusers="$1"
work="${2:-/tmp/sd3oom_e2e}"
mkdir -p "$work/scripts"
git -C "$diffusers" show 76b7d86a9a5c0c2186efa09c4a67b5f5666ac9e3:examples/dreambooth/train_dreambooth_sd3.py \
    > "$work/scripts/train_dreambooth_sd3.py"
cd "$work"
"$py" "$eco/tiny_pipeline.py" --spec "$eco/tiny_specs/sd3-tiny-full.json" --out pipe > tiny.log 2>&1
# The validation pipeline reads CLIP's length from tokenizer.model_max_length
# (pipeline_stable_diffusion_3.py); the tiny tokenizers have none.
"$py" - <<'PY'
import json
for t, n in (("tokenizer", 77), ("tokenizer_2", 77), ("tokenizer_3", 512)):
    p = f"pipe/{t}/tokenizer_config.json"
    d = json.load(open(p)); d["model_max_length"] = n; json.dump(d, open(p, "w"), indent=1)
import os, numpy as np
from PIL import Image
os.makedirs("images", exist_ok=True)
rng = np.random.default_rng(0)
for k in range(8):
    Image.fromarray(rng.integers(0, 256, size=(128, 128, 3), dtype=np.uint8)).save(f"images/{k:02d}.png")
PY
train() {  # $1 = the probe's folder (a sitecustomize.py), $2 = output folder name
    PYTHONPATH="$1" DITMEM_E2E_SCRIPT=train_dreambooth_sd3.py DITMEM_E2E_OUT="$work/measured.json" \
    DITMEM_CASTS_OUT="$work/casts.json" HF_HUB_OFFLINE=1 HF_HOME="$work/hf_home" \
    OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled \
    nice -n 10 "$py" scripts/train_dreambooth_sd3.py \
        --pretrained_model_name_or_path=pipe --instance_data_dir=images --output_dir="$2" \
        --mixed_precision=bf16 --instance_prompt="a photo of erhu" --resolution=128 \
        --train_batch_size=1 --gradient_accumulation_steps=4 --learning_rate=1e-4 \
        --lr_scheduler=constant --lr_warmup_steps=0 --max_train_steps=6 \
        --validation_prompt="A photo of erhu on the grass" --validation_epochs=1 \
        --num_validation_images=1 --seed=0 > "$2.log" 2>&1
}
# 1. live bytes and owners per microbatch (bench/ecosystem's e2e probe)
train "$eco/e2e_hook" out
cp measured.json "$here/measured.json"
"$py" "$here/summary.py" "$here/measured.json" > "$here/summary.md"
cat "$here/summary.md"
# 2. the 16-bit weight copies: saved by each forward, gc-visible at each backward's entry
train "$here/casts_hook" out-casts
cp casts.json "$here/casts.json"
"$py" -c 'import json,sys; d=json.load(open(sys.argv[1])); [print(b) for b in d["backwards"]]' "$here/casts.json"
