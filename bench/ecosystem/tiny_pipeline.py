"""Tiny local diffusers pipelines for the end-to-end runs (`end_to_end.py`), built offline.

Each pipeline is the family's own diffusers pipeline class (`FluxPipeline`,
`StableDiffusion3Pipeline`, `SanaPipeline`) saved with `save_pretrained`, so the training scripts'
`from_pretrained(args.pretrained_model_name_or_path, subfolder=...)` load it as they load the
published checkpoints: `model_index.json`, `transformer/`, `vae/`, `text_encoder*/`,
`tokenizer*/`, `scheduler/`. Nothing is downloaded:

- the transformer from the tiny diffusers config of the ditmem spec given (`model.diffusers`);
- the VAE with the family's latent channels and spatial factor (AutoencoderKL f8c16 with 4
  stages of 8 channels; Sana's AutoencoderDC f32c32 with 6 stages of 8 to 32: its output
  shortcut averages groups of the last stage's channels down to the 32 latent ones);
- the text encoders from tiny transformers configs whose widths are what the transformer reads
  (Flux: CLIP hidden = `pooled_projection_dim`, T5 `d_model` = `joint_attention_dim`; SD3: CLIP-L +
  CLIP-G hidden = `joint_attention_dim` = T5 `d_model`, their projections summing to
  `pooled_projection_dim`; Sana: Gemma-2 hidden = `caption_channels`);
- the tokenizers from a letter vocabulary (CLIP BPE with no merges, T5 unigram, Gemma BPE),
  built by transformers' tokenizers-backed classes and saved as fast tokenizers.

Weights are random (seeded): the runs measure memory, not images.

    python tiny_pipeline.py --spec SPEC.json --out DIR
"""

import argparse
import json
import os
import string

import torch

LETTERS = list(string.ascii_lowercase)


def clip_tokenizer():
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in LETTERS:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[])


def t5_tokenizer():
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in LETTERS] + [("\u2581" + c, -3.0) for c in LETTERS]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def gemma_tokenizer():
    from transformers import GemmaTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "\u2581": 5}
    for c in LETTERS:
        vocab[c] = len(vocab)
        vocab["\u2581" + c] = len(vocab)
    return GemmaTokenizerFast(vocab=vocab, merges=[])


def clip_encoder(cls, tok, hidden, projection):
    from transformers import CLIPTextConfig

    cfg = CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=projection,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return cls(cfg)


def t5_encoder(tok, d_model):
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=len(tok),
        d_model=d_model,
        d_kv=d_model // 4,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5EncoderModel(cfg)


def vae_kl(shift, scale):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[8, 8, 8, 8],
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=128,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=shift,
        scaling_factor=scale,
    )


def flow_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=3.0)


def build(spec: dict, out: str) -> dict:
    import diffusers

    torch.manual_seed(0)
    cfg = dict(spec["model"]["diffusers"])
    cls_name = cfg.pop("_class_name")
    transformer = getattr(diffusers, cls_name)(**cfg)
    if cls_name == "FluxTransformer2DModel":
        from diffusers import FluxPipeline
        from transformers import CLIPTextModel

        tok1, tok2 = clip_tokenizer(), t5_tokenizer()
        pipe = FluxPipeline(
            scheduler=flow_scheduler(),
            vae=vae_kl(0.1159, 0.3611),
            text_encoder=clip_encoder(CLIPTextModel, tok1, cfg["pooled_projection_dim"], 32),
            tokenizer=tok1,
            text_encoder_2=t5_encoder(tok2, cfg["joint_attention_dim"]),
            tokenizer_2=tok2,
            transformer=transformer,
        )
    elif cls_name == "SD3Transformer2DModel":
        from diffusers import StableDiffusion3Pipeline
        from transformers import CLIPTextModelWithProjection

        joint, pooled = cfg["joint_attention_dim"], cfg["pooled_projection_dim"]
        # CLIP-L and CLIP-G hidden states are concatenated (and padded to T5's width);
        # their pooled projections concatenated give the transformer's pooled input.
        l_hidden, g_hidden = joint // 3, joint - joint // 3
        l_proj = pooled // 3
        tok1, tok2, tok3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=flow_scheduler(),
            vae=vae_kl(0.0609, 1.5305),
            text_encoder=clip_encoder(CLIPTextModelWithProjection, tok1, l_hidden, l_proj),
            tokenizer=tok1,
            text_encoder_2=clip_encoder(
                CLIPTextModelWithProjection, tok2, g_hidden, pooled - l_proj
            ),
            tokenizer_2=tok2,
            text_encoder_3=t5_encoder(tok3, joint),
            tokenizer_3=tok3,
        )
    elif cls_name == "SanaTransformer2DModel":
        from diffusers import AutoencoderDC, SanaPipeline
        from transformers import Gemma2Config, Gemma2Model

        tok = gemma_tokenizer()
        d = cfg["caption_channels"]
        gemma = Gemma2Model(
            Gemma2Config(
                vocab_size=len(tok),
                hidden_size=d,
                intermediate_size=2 * d,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=d // 4,
                max_position_embeddings=512,
                pad_token_id=0,
                eos_token_id=1,
                bos_token_id=2,
            )
        )
        vae = AutoencoderDC(
            in_channels=3,
            latent_channels=cfg["in_channels"],
            attention_head_dim=8,
            encoder_block_types="ResBlock",
            decoder_block_types="ResBlock",
            encoder_block_out_channels=(8, 8, 16, 16, 32, 32),
            decoder_block_out_channels=(8, 8, 16, 16, 32, 32),
            encoder_layers_per_block=(1,) * 6,
            decoder_layers_per_block=(1,) * 6,
            encoder_qkv_multiscales=((),) * 6,
            decoder_qkv_multiscales=((),) * 6,
            decoder_norm_types="rms_norm",
            decoder_act_fns="silu",
            scaling_factor=0.41407,
        )
        pipe = SanaPipeline(
            tokenizer=tok,
            text_encoder=gemma,
            vae=vae,
            transformer=transformer,
            scheduler=flow_scheduler(),
        )
    else:
        raise SystemExit(f"no tiny pipeline for {cls_name}")
    pipe.save_pretrained(out)
    counts = {}
    for name, comp in pipe.components.items():
        if isinstance(comp, torch.nn.Module):
            counts[name] = {
                "class": type(comp).__name__,
                "params": sum(p.numel() for p in comp.parameters()),
            }
    with open(os.path.join(out, "ditmem_tiny_pipeline.json"), "w") as f:
        json.dump({"transformer_config": spec["model"]["diffusers"], "components": counts}, f, indent=1)
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True, help="ditmem spec JSON with model.diffusers")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.spec) as f:
        spec = json.load(f)
    print(json.dumps(build(spec, a.out), indent=1))


if __name__ == "__main__":
    main()
