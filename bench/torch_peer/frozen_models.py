"""The frozen models of the training pipelines, built from their configs (no weights): the text
encoders as transformers classes (as the diffusers training scripts load them) and the VAEs as
diffusers classes. `count_frozen.py` builds them at the published sizes on the meta device,
`frozen_peak.py` and `vae_peak.py` at sizes a CPU measures; one builder a model so that the
counted and the measured models are the same classes with the same settings.
"""

from diffusers import AutoencoderDC
from transformers import (  # noqa: F401  (re-exported: the scripts take the classes from here)
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

# The AutoencoderKL of SD, SD3 and Flux (`block_out_channels` 128-256-512-512): the latent
# channels and quant_conv are the callers' (4 with quant_conv for SD, 16 without for SD3/Flux).
KL = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
          up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
          layers_per_block=2)


def t5(cls, cfg_cls, *, vocab, d, ff, heads, dkv, layers, **extra):
    """A T5-style encoder (T5EncoderModel or UMT5EncoderModel) with the gated-GELU feed-forward
    of T5 v1.1 and umT5."""
    return cls(cfg_cls(vocab_size=vocab, d_model=d, d_kv=dkv, d_ff=ff, num_layers=layers,
                       num_heads=heads, feed_forward_proj="gated-gelu", **extra))


def clip(cls, *, vocab, d, inter, heads, layers, **extra):
    """A CLIP text encoder (CLIPTextModel or CLIPTextModelWithProjection), 77 positions, the
    projection as wide as the hidden size."""
    return cls(CLIPTextConfig(vocab_size=vocab, hidden_size=d, intermediate_size=inter,
                              num_hidden_layers=layers, num_attention_heads=heads,
                              max_position_embeddings=77, projection_dim=d, **extra))


def gemma(*, vocab, d, inter, heads, kv, hd, layers):
    """Gemma-2 (Sana's text encoder) with grouped-query attention."""
    return Gemma2Model(Gemma2Config(vocab_size=vocab, hidden_size=d, intermediate_size=inter,
                                    num_hidden_layers=layers, num_attention_heads=heads,
                                    num_key_value_heads=kv, head_dim=hd))


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
