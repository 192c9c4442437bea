"""Counts the parameters and buffers of the published diffusers transformers on the meta device.

For every preset of `ditmem params` (the same config values as crates/budget/src/families/presets.rs,
each taken from diffusers' conversion scripts and class defaults) this builds the diffusers class
from its config without allocating weights and prints one JSON object:

    {"diffusers": "0.42.1", "torch": "...", "presets": {NAME: {
        "class": "FluxTransformer2DModel", "parameters": N, "buffers": N,
        "tensors": [[TEMPLATE, SHAPE, KIND, INDICES], ...]}}}

KIND is "param", "buffer" (in the state dict) or "buffer-np" (non-persistent). A tensor of the
i-th element of a top-level ModuleList (`transformer_blocks.7.attn.to_q.weight`) is written once as
the template `transformer_blocks.{i}.attn.to_q.weight` with the indices holding it ("0-23",
"0-12,15"); other tensors have INDICES null. The table is exact: expand the templates to get every
name `model.named_parameters()` / `named_buffers()` gives.

VARIANTS are small configs off the published ones, for the options no preset exercises; their
entries also carry the config. With --configs DIR it also writes each preset's config.json there with `save_config`
(DIR/NAME/config.json), the files `ditmem params --model` must read.

    bench/torch_peer/.venv/bin/python bench/torch_peer/count_params.py \
        --out crates/budget/tests/data/diffusers_params.json --configs /tmp/ditmem-configs
"""

import argparse
import contextlib
import copy
import json
import os
import re
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch  # noqa: E402
import diffusers  # noqa: E402

# The published checkpoints' transformer/config.json values (see presets.rs for each source).
PRESETS = {}


def like(name, **changes):
    """PRESETS[name] with some values changed: a sibling checkpoint of the same conversion
    script."""
    return {**copy.deepcopy(PRESETS[name]), **changes}


PRESETS["dit-xl-2-256"] = {
    # facebook/DiT-XL-2-256: scripts/convert_dit_to_diffusers.py (image_size 256).
    "_class_name": "Transformer2DModel",
    "sample_size": 32,
    "num_layers": 28,
    "attention_head_dim": 72,
    "in_channels": 4,
    "out_channels": 8,
    "patch_size": 2,
    "attention_bias": True,
    "num_attention_heads": 16,
    "activation_fn": "gelu-approximate",
    "num_embeds_ada_norm": 1000,
    "norm_type": "ada_norm_zero",
    "norm_elementwise_affine": False,
}
# facebook/DiT-XL-2-512: the same script with --image_size 512.
PRESETS["dit-xl-2-512"] = like("dit-xl-2-256", sample_size=64)
# PixArt-alpha/PixArt-XL-2-1024-MS: scripts/convert_pixart_alpha_to_diffusers.py, the DiT-XL/2
# transformer with cross-attention to the caption and adaLN-single.
PRESETS["pixart-alpha-1024"] = like(
    "dit-xl-2-256",
    sample_size=128,
    cross_attention_dim=1152,
    norm_type="ada_norm_single",
    norm_eps=1e-6,
    caption_channels=4096,
)
# PixArt-alpha/PixArt-Sigma-XL-2-1024-MS: scripts/convert_pixart_sigma_to_diffusers.py
# (image_size 1024 -> interpolation_scale 2, no --micro_condition).
PRESETS["pixart-sigma-1024"] = like(
    "pixart-alpha-1024", interpolation_scale=2, use_additional_conditions=False
)
PRESETS["sd3-medium"] = {
    # stabilityai/stable-diffusion-3-medium-diffusers: scripts/convert_sd3_to_diffusers.py.
    "_class_name": "SD3Transformer2DModel",
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "out_channels": 16,
    "pos_embed_max_size": 192,
}
# stabilityai/stable-diffusion-3.5-medium: convert_sd3_to_diffusers.py (MMDiT-X: attn2 in
# joint blocks 0-12, ln_q present, pos_embed 384x384 patches).
PRESETS["sd3.5-medium"] = like(
    "sd3-medium",
    pos_embed_max_size=384,
    qk_norm="rms_norm",
    dual_attention_layers=list(range(13)),
)
# stabilityai/stable-diffusion-3.5-large: convert_sd3_to_diffusers.py (38 joint blocks).
PRESETS["sd3.5-large"] = like(
    "sd3-medium",
    num_layers=38,
    num_attention_heads=38,
    caption_projection_dim=2432,
    qk_norm="rms_norm",
    dual_attention_layers=[],
)
PRESETS["flux.1-dev"] = {
    # black-forest-labs/FLUX.1-dev: scripts/convert_flux_to_diffusers.py (guidance_in present).
    "_class_name": "FluxTransformer2DModel",
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
PRESETS["flux.1-schnell"] = like("flux.1-dev", guidance_embeds=False)
PRESETS["sana-600m"] = {
    # Efficient-Large-Model/Sana_600M_1024px_diffusers: convert_sana_to_diffusers.py
    # (SanaMS_600M_P1_D28, image_size 1024).
    "_class_name": "SanaTransformer2DModel",
    "in_channels": 32,
    "out_channels": 32,
    "num_attention_heads": 36,
    "attention_head_dim": 32,
    "num_layers": 28,
    "num_cross_attention_heads": 16,
    "cross_attention_head_dim": 72,
    "cross_attention_dim": 1152,
    "caption_channels": 2304,
    "mlp_ratio": 2.5,
    "attention_bias": False,
    "sample_size": 32,
    "patch_size": 1,
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "interpolation_scale": None,
}
# Efficient-Large-Model/Sana_1600M_1024px_diffusers: SanaMS_1600M_P1_D20, image_size 1024.
PRESETS["sana-1600m"] = like(
    "sana-600m",
    num_attention_heads=70,
    num_layers=20,
    num_cross_attention_heads=20,
    cross_attention_head_dim=112,
    cross_attention_dim=2240,
)
PRESETS["wan2.1-1.3b"] = {
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers: scripts/convert_wan_to_diffusers.py "Wan-T2V-1.3B".
    "_class_name": "WanTransformer3DModel",
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 8960,
    "freq_dim": 256,
    "in_channels": 16,
    "num_attention_heads": 12,
    "num_layers": 30,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "text_dim": 4096,
}
# Wan-AI/Wan2.1-T2V-14B-Diffusers: convert_wan_to_diffusers.py "Wan-T2V-14B".
PRESETS["wan2.1-14b"] = like("wan2.1-1.3b", ffn_dim=13824, num_attention_heads=40, num_layers=40)

# Small configs off the published ones: every option the reader takes that no preset exercises.
VARIANTS = {
    "dit-tiny-no-bias": {"_class_name": "DiTTransformer2DModel", "num_layers": 2,
                         "num_attention_heads": 2, "attention_head_dim": 8, "sample_size": 8,
                         "patch_size": 4, "attention_bias": False, "num_embeds_ada_norm": 10,
                         "out_channels": None, "activation_fn": "gelu"},
    "pixart-tiny-no-caption": {"_class_name": "PixArtTransformer2DModel", "num_layers": 2,
                               "num_attention_heads": 3, "attention_head_dim": 8,
                               "sample_size": 16, "cross_attention_dim": 40,
                               "caption_channels": None, "out_channels": None},
    "pixart-tiny-ms": {"_class_name": "PixArtTransformer2DModel", "num_layers": 1,
                       "num_attention_heads": 3, "attention_head_dim": 8, "sample_size": 16,
                       "cross_attention_dim": 24, "caption_channels": 40,
                       "use_additional_conditions": True, "attention_bias": False},
    "sd3-tiny-dual-last": {"_class_name": "SD3Transformer2DModel", "num_layers": 3,
                           "num_attention_heads": 2, "attention_head_dim": 8,
                           "caption_projection_dim": 16, "joint_attention_dim": 20,
                           "pooled_projection_dim": 12, "sample_size": 16,
                           "pos_embed_max_size": None, "dual_attention_layers": [0, 2],
                           "qk_norm": "rms_norm", "out_channels": None, "in_channels": 4},
    "flux-tiny-patch2": {"_class_name": "FluxTransformer2DModel", "num_layers": 1,
                         "num_single_layers": 2, "num_attention_heads": 2,
                         "attention_head_dim": 16, "joint_attention_dim": 20,
                         "pooled_projection_dim": 12, "in_channels": 8, "out_channels": 4,
                         "patch_size": 2, "axes_dims_rope": [4, 6, 6], "guidance_embeds": True},
    "sana-tiny-qknorm-pos": {"_class_name": "SanaTransformer2DModel", "num_layers": 2,
                             "num_attention_heads": 4, "attention_head_dim": 8,
                             "num_cross_attention_heads": 2, "cross_attention_head_dim": 12,
                             "cross_attention_dim": 32, "caption_channels": 20,
                             "mlp_ratio": 2.5, "attention_bias": True, "sample_size": 8,
                             "patch_size": 2, "interpolation_scale": 1.0,
                             "qk_norm": "rms_norm_across_heads", "out_channels": None},
    "wan-tiny-no-cross-norm": {"_class_name": "WanTransformer3DModel", "num_layers": 2,
                               "num_attention_heads": 2, "attention_head_dim": 12,
                               "ffn_dim": 40, "text_dim": 20, "freq_dim": 32,
                               "in_channels": 4, "out_channels": None,
                               "patch_size": [2, 2, 2], "cross_attn_norm": False,
                               "rope_max_seq_len": 64},
}

# Transformer2DModel's remapping by norm_type (diffusers models/model_loading_utils.py
# _CLASS_REMAPPING_DICT).
REMAP = {"ada_norm_zero": "DiTTransformer2DModel", "ada_norm_single": "PixArtTransformer2DModel"}


def model_class(config):
    name = config["_class_name"]
    if name == "Transformer2DModel":
        name = REMAP[config["norm_type"]]
    return getattr(diffusers, name)


@contextlib.contextmanager
def empty_weights():
    """Parameters on the meta device, buffers as the class computes them (accelerate's
    init_empty_weights(include_buffers=False), written out: accelerate is not needed)."""
    old = torch.nn.Module.register_parameter

    def register(module, name, param):
        old(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = old


def build(config):
    cls = model_class(config)
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    try:
        with torch.device("meta"):
            return cls.from_config(kwargs)
    except Exception:  # a class that computes a buffer with numpy: only the parameters on meta
        with empty_weights():
            return cls.from_config(kwargs)


def indices_text(indices):
    indices = sorted(indices)
    runs, start, prev = [], indices[0], indices[0]
    for i in indices[1:]:
        if i != prev + 1:
            runs.append((start, prev))
            start = i
        prev = i
    runs.append((start, prev))
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def table(model):
    persistent = set(model.state_dict().keys())
    rows = [(n, list(p.shape), "param") for n, p in model.named_parameters()]
    rows += [
        (n, list(b.shape), "buffer" if n in persistent else "buffer-np")
        for n, b in model.named_buffers()
    ]
    grouped = {}
    order = []
    for name, shape, kind in rows:
        m = re.match(r"^([A-Za-z_]+)\.(\d+)\.(.*)$", name)
        if m:
            key = (f"{m.group(1)}.{{i}}.{m.group(3)}", tuple(shape), kind)
            idx = int(m.group(2))
        else:
            key = (name, tuple(shape), kind)
            idx = None
        if key not in grouped:
            grouped[key] = []
            order.append(key)
        if idx is not None:
            grouped[key].append(idx)
    return [
        [t, list(s), k, indices_text(grouped[(t, s, k)]) if grouped[(t, s, k)] else None]
        for (t, s, k) in order
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the JSON here (default: stdout)")
    ap.add_argument("--configs", help="write DIR/NAME/config.json for every preset")
    ap.add_argument("--only", help="comma-separated preset names")
    args = ap.parse_args()
    everything = {**PRESETS, **VARIANTS}
    names = args.only.split(",") if args.only else list(everything)
    out = {"diffusers": diffusers.__version__, "torch": torch.__version__, "presets": {}}
    for name in names:
        config = everything[name]
        model = build(config)
        params = sum(p.numel() for p in model.parameters())
        buffers = sum(b.numel() for b in model.buffers())
        out["presets"][name] = {
            "class": type(model).__name__,
            "parameters": params,
            "buffers": buffers,
            "tensors": table(model),
        }
        if name in VARIANTS:  # the config the Rust test reads (presets are ditmem's own)
            out["presets"][name]["config"] = config
        print(f"{name}: {type(model).__name__} {params:,} parameters, {buffers:,} buffer elements",
              file=sys.stderr)
        if args.configs:
            folder = os.path.join(args.configs, name)
            os.makedirs(folder, exist_ok=True)
            model.save_config(folder)
        del model
    text = json.dumps(out, indent=None, separators=(",", ":"))
    # One preset per line and one tensor per line: small, and diffs read well.
    text = text.replace('"tensors":[[', '"tensors":[\n[').replace("],[\"", "],\n[\"")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
