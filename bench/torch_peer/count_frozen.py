#!/usr/bin/env python3
"""Parameter counts of the frozen parts of each family's training pipeline, built on the meta
device from the published configs (no weights): the text encoders (transformers classes, as the
diffusers training scripts load them) and the VAE encoders (diffusers classes; encoder and its
quant_conv only, what `vae.encode` runs). The numbers are pinned in
`crates/budget/src/families/frozen.rs`.

    bench/torch_peer/.venv/bin/python bench/torch_peer/count_frozen.py [--json]

Configs: google/t5-v1_1-xxl and google/umt5-xxl (`text_encoder_2` / `text_encoder` of the Flux,
SD3, PixArt and Wan checkpoints), openai/clip-vit-large-patch14 (CLIP-L), laion
CLIP-ViT-bigG-14 (SD3's `text_encoder_2`), google/gemma-2-2b-it (Sana's `text_encoder`), the
AutoencoderKL of SD (`block_out_channels` 128-256-512-512, 4 latent channels, quant_conv) and of
SD3/Flux (16 latent channels, no quant_conv), Sana's DC-AE f32c32 (AutoencoderDC), Wan 2.1's
AutoencoderKLWan.
"""

import json
import os
import sys

import torch
from diffusers import AutoencoderKL, AutoencoderKLWan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import frozen_models as fm  # noqa: E402


def count(m):
    return sum(p.numel() for p in m.parameters())


def main():
    out = {}
    with torch.device("meta"):
        xxl = dict(d=4096, ff=10240, heads=64, dkv=64, layers=24, relative_attention_num_buckets=32)
        out["T5-XXL encoder"] = count(fm.t5(fm.T5EncoderModel, fm.T5Config, vocab=32128, **xxl))
        out["umT5-XXL encoder"] = count(fm.t5(fm.UMT5EncoderModel, fm.UMT5Config, vocab=256384, **xxl))
        clip_l = dict(vocab=49408, d=768, inter=3072, heads=12, layers=12, hidden_act="quick_gelu")
        out["CLIP-L text"] = count(fm.clip(fm.CLIPTextModel, **clip_l))
        out["CLIP-L text with projection"] = count(fm.clip(fm.CLIPTextModelWithProjection, **clip_l))
        clip_g = dict(vocab=49408, d=1280, inter=5120, heads=20, layers=32, hidden_act="gelu")
        out["CLIP-G text with projection"] = count(fm.clip(fm.CLIPTextModelWithProjection, **clip_g))
        out["Gemma-2-2B"] = count(fm.gemma(vocab=256000, d=2304, inter=9216, heads=8, kv=4, hd=256, layers=26))
        sd = AutoencoderKL(latent_channels=4, **fm.KL)
        out["SD VAE encoder"] = count(sd.encoder) + count(sd.quant_conv)
        v16 = AutoencoderKL(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, **fm.KL)
        out["SD3/Flux VAE encoder"] = count(v16.encoder)
        out["SD3/Flux VAE decoder"] = count(v16.decoder)
        dc = fm.dcae_sana()
        out["DC-AE f32c32 encoder"] = count(dc.encoder)
        out["DC-AE f32c32 decoder"] = count(dc.decoder)
        wan = AutoencoderKLWan()
        out["Wan-VAE encoder"] = count(wan.encoder) + count(wan.quant_conv)
    if "--json" in sys.argv:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(f"{k:30s} {v:>16,}")


if __name__ == "__main__":
    main()
