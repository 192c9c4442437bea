"""A diffusers-style LoRA training step measured beside ditmem's prediction.

    python python/examples/lora_measure.py --model PixArt-alpha/PixArt-Sigma-XL-2-1024-MS
    python python/examples/lora_measure.py --config transformer/config.json   # random weights

Needs torch, diffusers and peft (and a CUDA GPU for the snapshot). The five ditmem lines are
marked `# ditmem`; the rest is the usual loop of diffusers' train_text_to_image_lora.py: a frozen
bf16 transformer, LoRA adapters on the attention projections, AdamW on the adapters, one step.
`--config` builds the model from its config.json with random weights (the same memory, no
download).
"""

import argparse
import json

import torch
from diffusers import PixArtTransformer2DModel
from peft import LoraConfig, inject_adapter_in_model

import ditmem  # ditmem
import ditmem.torch as dmt  # ditmem

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="PixArt-alpha/PixArt-Sigma-XL-2-1024-MS")
ap.add_argument("--config", help="a transformer config.json: random weights, no download")
ap.add_argument("--resolution", type=int, default=1024)
ap.add_argument("--rank", type=int, default=16)
ap.add_argument("--gpu", default=None, help="a ditmem catalog card (default: none named)")
args = ap.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if args.config:
    transformer = PixArtTransformer2DModel.from_config(json.load(open(args.config)))
else:
    transformer = PixArtTransformer2DModel.from_pretrained(args.model, subfolder="transformer")
transformer.requires_grad_(False)
transformer.to(device, dtype=torch.bfloat16)

# Before the adapters go in: ditmem reads the model's config and checks its parameter count.
est = ditmem.estimate(model=transformer, lora_rank=args.rank, resolution=args.resolution,  # ditmem
                      batch=1, recompute="none", text_tokens=300, gpu=args.gpu,
                      runtime="pytorch:cuda" if device.type == "cuda" else "pytorch:cpu")

lora = LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
                  target_modules=["to_k", "to_q", "to_v", "to_out.0"])
transformer = inject_adapter_in_model(lora, transformer)  # as add_adapter, for any nn.Module
for p in transformer.parameters():
    if p.requires_grad:
        p.data = p.data.float()  # LoRA weights in fp32, as the script's cast_training_params
opt = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=1e-4)

cfg = transformer.config
side = args.resolution // 8
latents = torch.randn(1, cfg.in_channels, side, side, device=device, dtype=torch.bfloat16)
text = torch.randn(1, 300, cfg.caption_channels, device=device, dtype=torch.bfloat16)
t = torch.randint(0, 1000, (1,), device=device)
added = {"resolution": None, "aspect_ratio": None}


def step():
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = transformer(latents, encoder_hidden_states=text, timestep=t,
                          added_cond_kwargs=added).sample
    loss = torch.nn.functional.mse_loss(out[:, : cfg.in_channels].float(), latents.float())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


if device.type == "cuda":
    with dmt.snapshot("lora_step.pickle"):  # ditmem: `ditmem compare --snapshot lora_step.pickle`
        m = dmt.measure(step, warmup=1, steps=3)  # ditmem
else:
    m = dmt.measure(step, warmup=1, steps=3, resident=[transformer, opt])
print(est, m, dmt.compare(est, m), sep="\n\n")  # ditmem
