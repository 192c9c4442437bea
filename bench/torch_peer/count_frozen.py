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
import sys

import torch
from diffusers import AutoencoderDC, AutoencoderKL, AutoencoderKLWan
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    Gemma2Config,
    Gemma2Model,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)


def count(m):
    return sum(p.numel() for p in m.parameters())


def t5xxl(cls, cfg_cls, vocab):
    cfg = cfg_cls(
        vocab_size=vocab, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
    )
    return cls(cfg)


def dcae_sana():
    """DC-AE f32c32 as Sana 1.0 reads it: `dc_ae_f32c32("dc-ae-f32c32-sana-1.0")` of MIT Han Lab's
    efficientvit `dc_ae.py` (ResBlock ×3 then EfficientViT blocks with 5×5 multi-scale qkv,
    widths 128-256-512-512-1024-1024, encoder depths 2-2-2-3-3-3, Conv downsampling)."""
    vit = ["ResBlock", "ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock", "EfficientViTBlock"]
    return AutoencoderDC(
        in_channels=3, latent_channels=32,
        encoder_block_types=vit, decoder_block_types=vit,
        encoder_block_out_channels=[128, 256, 512, 512, 1024, 1024],
        decoder_block_out_channels=[128, 256, 512, 512, 1024, 1024],
        encoder_layers_per_block=[2, 2, 2, 3, 3, 3],
        decoder_layers_per_block=[3, 3, 3, 3, 3, 3],
        encoder_qkv_multiscales=[[], [], [], [5], [5], [5]],
        decoder_qkv_multiscales=[[], [], [], [5], [5], [5]],
        upsample_block_type="interpolate", downsample_block_type="Conv",
        decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407,
    )


def main():
    out = {}
    with torch.device("meta"):
        out["T5-XXL encoder"] = count(t5xxl(T5EncoderModel, T5Config, 32128))
        out["umT5-XXL encoder"] = count(t5xxl(UMT5EncoderModel, UMT5Config, 256384))
        clip_l = CLIPTextConfig(
            vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
            num_attention_heads=12, max_position_embeddings=77, projection_dim=768,
            hidden_act="quick_gelu",
        )
        out["CLIP-L text"] = count(CLIPTextModel(clip_l))
        out["CLIP-L text with projection"] = count(CLIPTextModelWithProjection(clip_l))
        clip_g = CLIPTextConfig(
            vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
            num_attention_heads=20, max_position_embeddings=77, projection_dim=1280,
            hidden_act="gelu",
        )
        out["CLIP-G text with projection"] = count(CLIPTextModelWithProjection(clip_g))
        gemma = Gemma2Config(
            vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
            num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        )
        out["Gemma-2-2B"] = count(Gemma2Model(gemma))
        kl = dict(
            in_channels=3, out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4,
            block_out_channels=[128, 256, 512, 512], layers_per_block=2,
        )
        sd = AutoencoderKL(latent_channels=4, **kl)
        out["SD VAE encoder"] = count(sd.encoder) + count(sd.quant_conv)
        v16 = AutoencoderKL(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, **kl)
        out["SD3/Flux VAE encoder"] = count(v16.encoder)
        out["SD3/Flux VAE decoder"] = count(v16.decoder)
        dc = dcae_sana()
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
