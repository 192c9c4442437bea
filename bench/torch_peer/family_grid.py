#!/usr/bin/env python3
"""The family grid: ≥ 30 tiny specs of the diffusers families (dit, pixart, sd3, flux, sana, wan),
each run through `family_peer.py` on the CPU; optionally held against `ditmem estimate --runtime
pytorch`.

    bench/torch_peer/.venv/bin/python bench/torch_peer/family_grid.py [--write-specs-only]
        [--only NAME,...] [--ditmem target/release/ditmem] [--out runs/<date>-<cpu>-families/families.json]
        [--threads 2]

The specs are written to specs/families/NAME.json (committed) before anything runs. The tiny
configs are the presets of crates/budget/src/families/presets.rs with the same keys, shrunk (a
few layers, hidden 64, 4 heads, 64²–256² images). Every family gets fp32 and bf16-mixed, gradient
checkpointing none and all, for-loop and foreach AdamW, LoRA on at least one spec, and some odd
token counts.

With --ditmem (default: target/release/ditmem of the repository when it exists) each spec is
also estimated; a spec the binary rejects prints its one-line error and the grid goes on. The
summary gives max and median |pred/meas − 1| over the specs it accepted.
"""

import argparse
import platform
import copy
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SPEC_DIR = os.path.join(HERE, "specs", "families")

H = 64  # hidden of every tiny model: 4 heads × 16 (wan: 2 × 32)


def dit_cfg(latent):
    # dit-xl-2-256 shrunk: 2 layers, 4 × 16 heads; sample_size = the latent side (its pos_embed).
    return {"_class_name": "Transformer2DModel", "sample_size": latent, "num_layers": 2,
            "attention_head_dim": 16, "in_channels": 4, "out_channels": 8, "patch_size": 2,
            "attention_bias": True, "num_attention_heads": 4, "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": 1000, "norm_type": "ada_norm_zero",
            "norm_elementwise_affine": False}


def pixart_cfg(latent, sigma=False, ms=False):
    # pixart-alpha-1024 / pixart-sigma-1024 shrunk: caption_channels 4096 → 96.
    c = {"_class_name": "Transformer2DModel", "sample_size": latent, "num_layers": 2,
         "attention_head_dim": 16, "in_channels": 4, "out_channels": 8, "patch_size": 2,
         "attention_bias": True, "num_attention_heads": 4, "cross_attention_dim": H,
         "activation_fn": "gelu-approximate", "num_embeds_ada_norm": 1000,
         "norm_type": "ada_norm_single", "norm_elementwise_affine": False, "norm_eps": 1e-6,
         "caption_channels": 96}
    if sigma:
        c.update(interpolation_scale=2, use_additional_conditions=False)
    if ms:  # the α 1024-MS checkpoints' micro-conditions (sample_size 128 turns them on); the
        # size embedders split the hidden in 3: 3 heads × 16.
        c.update(use_additional_conditions=True, num_attention_heads=3, cross_attention_dim=48)
    return c


def sd3_cfg(latent, variant="sd3-medium"):
    # sd3-medium shrunk: joint_attention_dim 4096 → 96, pooled 2048 → 80, caption dim = hidden.
    c = {"_class_name": "SD3Transformer2DModel", "sample_size": latent, "patch_size": 2,
         "in_channels": 16, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 4,
         "joint_attention_dim": 96, "caption_projection_dim": H, "pooled_projection_dim": 80,
         "out_channels": 16, "pos_embed_max_size": 24}
    if variant == "sd3.5-medium":  # MMDiT-X: ln_q (rms_norm) and attn2 in the first blocks
        c.update(qk_norm="rms_norm", dual_attention_layers=[0])
    elif variant == "sd3.5-large":
        c.update(qk_norm="rms_norm", dual_attention_layers=[])
    return c


def flux_cfg(guidance=True):
    # flux.1-dev / flux.1-schnell shrunk: 1 double + 2 single blocks, head 16 = rope axes 4+6+6.
    return {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 64,
            "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
            "num_attention_heads": 4, "joint_attention_dim": 96, "pooled_projection_dim": 48,
            "guidance_embeds": guidance, "axes_dims_rope": [4, 6, 6]}


def sana_cfg(latent):
    # sana-600m shrunk: caption_channels 2304 → 96, cross heads 2 × 32 = hidden.
    return {"_class_name": "SanaTransformer2DModel", "in_channels": 32, "out_channels": 32,
            "num_attention_heads": 4, "attention_head_dim": 16, "num_layers": 2,
            "num_cross_attention_heads": 2, "cross_attention_head_dim": 32,
            "cross_attention_dim": H, "caption_channels": 96, "mlp_ratio": 2.5,
            "attention_bias": False, "sample_size": latent, "patch_size": 1,
            "norm_elementwise_affine": False, "norm_eps": 1e-6, "interpolation_scale": None}


def wan_cfg():
    # wan2.1-1.3b shrunk: 2 layers, 2 heads × 32, ffn 8960 → 128, text_dim 4096 → 96.
    return {"_class_name": "WanTransformer3DModel", "added_kv_proj_dim": None,
            "attention_head_dim": 32, "cross_attn_norm": True, "eps": 1e-06, "ffn_dim": 128,
            "freq_dim": 256, "in_channels": 16, "num_attention_heads": 2, "num_layers": 2,
            "out_channels": 16, "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads",
            "text_dim": 96}


LORA_TARGETS = {
    "dit": ["to_q", "to_k", "to_v", "to_out.0"],
    "pixart": ["to_q", "to_k", "to_v", "to_out.0"],
    "sd3": ["to_q", "to_k", "to_v", "to_out.0"],
    "flux": ["to_q", "to_k", "to_v", "to_out.0"],
    "sana": ["to_k", "to_q", "to_v"],  # train_dreambooth_lora_sana.py's default
    "wan": ["to_q", "to_k", "to_v", "to_out.0"],
}
VAE = {"dit": (8, 4), "pixart": (8, 4), "sd3": (8, 16), "flux": (8, 16), "sana": (32, 32), "wan": (8, 16)}


def make(name, family, cfg, res, batch, precision, recompute, impl, text_tokens=None, frames=1,
         lora=None, ema=False, optimizer="adamw"):
    factor, lc = VAE[family]
    w = {"height": res, "width": res, "vae_factor": factor, "latent_channels": lc, "batch": batch,
         "microbatch": batch, "accumulation": 1, "ranks": 1, "frames": frames}
    if text_tokens is not None:
        w["text_tokens"] = text_tokens
    if family == "wan":
        w["vae_temporal_factor"] = 4
    # depth (every block of every stack) and hidden (heads × head size): what ditmem derives from
    # the config; written so that a reader which checks them finds them.
    depth = cfg["num_layers"] + cfg.get("num_single_layers", 0)
    m = {"name": name, "depth": depth, "hidden": cfg["num_attention_heads"] * cfg["attention_head_dim"],
         "diffusers": cfg}
    recipe = {
        "precision": precision,
        "optimizer": optimizer,
        "optimizer_impl": impl,
        "attention": "memory-efficient",
        "recompute": recompute,
        # PEFT target_modules names (ditmem's LoraSpec.modules)
        "lora": {"rank": lora, "modules": LORA_TARGETS[family]} if lora else None,
        "zero_stage": 0,
        "latents": "cached",
        "ema": {"enabled": ema, "dtype": "f32", "decay": 0.9999},
    }
    if family in ("dit", "pixart"):
        recipe["prediction"] = "eps"  # flow families: the class decides (ditmem has eps | v)
    return name, {
        "model": m,
        "workload": w,
        "recipe": recipe,
        "runtime": "pytorch:cpu",
    }


def grid():
    s = []
    # DiT (diffusers): class labels, DDPM ε, learned sigma.
    s.append(make("dit-fp32-none-loop", "dit", dit_cfg(16), 128, 4, "fp32", "none", "for-loop"))
    s.append(make("dit-fp32-all-foreach", "dit", dit_cfg(16), 128, 4, "fp32", "all", "foreach"))
    s.append(make("dit-bf16-none-foreach", "dit", dit_cfg(16), 128, 4, "bf16-mixed", "none", "foreach"))
    s.append(make("dit-bf16-all-loop-ema", "dit", dit_cfg(8), 64, 4, "bf16-mixed", "all", "for-loop", ema=True))
    s.append(make("dit-bf16-lora4-none-loop", "dit", dit_cfg(16), 128, 4, "bf16-mixed", "none", "for-loop", lora=4))
    s.append(make("dit-fp32-none-sgd", "dit", dit_cfg(16), 128, 4, "fp32", "none", "foreach", optimizer="sgd"))
    # PixArt α / Σ: T5 tokens with the padded-prompt mask.
    s.append(make("pixart-fp32-none-loop", "pixart", pixart_cfg(16), 128, 4, "fp32", "none", "for-loop", [120]))
    s.append(make("pixart-fp32-all-foreach-t37", "pixart", pixart_cfg(16), 128, 4, "fp32", "all", "foreach", [37]))
    s.append(make("pixart-bf16-none-foreach-sigma", "pixart", pixart_cfg(16, sigma=True), 128, 4, "bf16-mixed", "none", "foreach", [300]))
    s.append(make("pixart-bf16-all-loop-ms", "pixart", pixart_cfg(8, ms=True), 64, 4, "bf16-mixed", "all", "for-loop", [120]))
    s.append(make("pixart-bf16-lora8-none-loop", "pixart", pixart_cfg(16), 128, 4, "bf16-mixed", "none", "for-loop", [120], lora=8))
    # SD3 / SD3.5: CLIP + T5 tokens concatenated, pooled vector.
    s.append(make("sd3-fp32-none-loop", "sd3", sd3_cfg(16), 128, 4, "fp32", "none", "for-loop", [77, 77]))
    s.append(make("sd3-fp32-all-foreach", "sd3", sd3_cfg(16), 128, 4, "fp32", "all", "foreach", [77, 77]))
    s.append(make("sd3-bf16-none-foreach-35m", "sd3", sd3_cfg(16, "sd3.5-medium"), 128, 4, "bf16-mixed", "none", "foreach", [77, 77]))
    s.append(make("sd3-bf16-all-loop-35l-t33", "sd3", sd3_cfg(8, "sd3.5-large"), 64, 4, "bf16-mixed", "all", "for-loop", [77, 33]))
    s.append(make("sd3-bf16-lora4-none-loop", "sd3", sd3_cfg(16), 128, 4, "bf16-mixed", "none", "for-loop", [77, 77], lora=4))
    s.append(make("sd3-fp32-lora4-all-foreach-35m", "sd3", sd3_cfg(16, "sd3.5-medium"), 128, 1, "fp32", "all", "foreach", [77, 77], lora=4))
    # Flux: T5 sequence, CLIP pooled, ids, guidance (dev) or none (schnell).
    s.append(make("flux-fp32-none-loop", "flux", flux_cfg(), 128, 4, "fp32", "none", "for-loop", [77, 128]))
    s.append(make("flux-fp32-all-foreach-schnell", "flux", flux_cfg(False), 128, 4, "fp32", "all", "foreach", [77, 128]))
    s.append(make("flux-bf16-none-foreach", "flux", flux_cfg(), 128, 4, "bf16-mixed", "none", "foreach", [77, 128]))
    s.append(make("flux-bf16-all-loop-t101", "flux", flux_cfg(), 64, 4, "bf16-mixed", "all", "for-loop", [77, 101]))
    s.append(make("flux-bf16-lora4-none-loop", "flux", flux_cfg(), 128, 4, "bf16-mixed", "none", "for-loop", [77, 128], lora=4))
    s.append(make("flux-bf16-lora8-all-foreach-schnell", "flux", flux_cfg(False), 128, 1, "bf16-mixed", "all", "foreach", [77, 64], lora=8))
    # Sana: DC-AE f32c32 latents, Gemma tokens with mask, linear attention.
    s.append(make("sana-fp32-none-loop", "sana", sana_cfg(8), 256, 4, "fp32", "none", "for-loop", [300]))
    s.append(make("sana-fp32-all-foreach", "sana", sana_cfg(8), 256, 4, "fp32", "all", "foreach", [300]))
    s.append(make("sana-bf16-none-foreach-t77", "sana", sana_cfg(8), 256, 4, "bf16-mixed", "none", "foreach", [77]))
    s.append(make("sana-bf16-all-loop", "sana", sana_cfg(4), 128, 4, "bf16-mixed", "all", "for-loop", [300]))
    s.append(make("sana-bf16-lora4-none-loop", "sana", sana_cfg(8), 256, 4, "bf16-mixed", "none", "for-loop", [300], lora=4))
    # Wan 2.1: video latents (f8 × t4, c16), umT5 tokens.
    s.append(make("wan-fp32-none-loop-f5", "wan", wan_cfg(), 64, 4, "fp32", "none", "for-loop", [512], frames=5))
    s.append(make("wan-fp32-all-foreach-f5", "wan", wan_cfg(), 64, 4, "fp32", "all", "foreach", [512], frames=5))
    s.append(make("wan-bf16-none-foreach-f9-t77", "wan", wan_cfg(), 64, 1, "bf16-mixed", "none", "foreach", [77], frames=9))
    s.append(make("wan-bf16-all-loop-f1", "wan", wan_cfg(), 128, 4, "bf16-mixed", "all", "for-loop", [512], frames=1))
    s.append(make("wan-bf16-lora4-none-loop-f5", "wan", wan_cfg(), 64, 4, "bf16-mixed", "none", "for-loop", [512], frames=5, lora=4))
    s.append(make("wan-fp32-lora4-all-foreach-f5-ema", "wan", wan_cfg(), 64, 4, "fp32", "all", "foreach", [300], frames=5, lora=4, ema=True))
    return s


# Feed-forward LoRA targets (PEFT target_modules) per family: the blocks' MLP linears.
FF_TARGETS = {
    "dit": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"],
    "pixart": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"],
    "sd3": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"],
    "flux": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_mlp"],
    "sana": ["to_k", "to_q", "to_v", "to_out.0"],  # Sana's FF is convolutional (GLUMBConv)
    "wan": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"],
}
LORA_SPEC_DIR = os.path.join(HERE, "specs", "families_lora")


def lora_grid():
    """Issue 49's LoRA grid: every family × fp32 / bf16-mixed × checkpointing none / all, ranks
    4, 8, 16 and the default / feed-forward targets spread over the rows (tiny configs as grid());
    then per family two bf16-mixed rows with the adapters in bf16 (`lora.dtype = "weight"`)."""
    cfgs = {
        "dit": (dit_cfg(16), 128, 4, None, 1),
        "pixart": (pixart_cfg(16), 128, 4, [120], 1),
        "sd3": (sd3_cfg(16), 128, 4, [77, 77], 1),
        "flux": (flux_cfg(), 128, 4, [77, 128], 1),
        "sana": (sana_cfg(8), 256, 4, [300], 1),
        "wan": (wan_cfg(), 64, 4, [512], 5),
    }
    s = []
    for fam, (cfg, res, batch, tt, frames) in cfgs.items():
        for i, (prec, rc) in enumerate([("fp32", "none"), ("fp32", "all"), ("bf16-mixed", "none"), ("bf16-mixed", "all")]):
            rank = (4, 8, 16, 8)[i]
            ff = i in (1, 2)
            impl = "foreach" if i % 2 else "for-loop"
            name = f"{fam}-{'bf16' if prec != 'fp32' else 'fp32'}-lora{rank}{'ff' if ff else ''}-{rc}"
            n, spec = make(name, fam, cfg, res, batch, prec, rc, impl, tt, frames=frames, lora=rank)
            if ff:
                spec["recipe"]["lora"]["modules"] = FF_TARGETS[fam]
            s.append((n, spec))
        # Adapters kept in bf16 (lora.dtype "weight": the diffusers scripts under bf16).
        for rc, rank, ff in (("none", 8, True), ("all", 4, False)):
            name = f"{fam}-bf16-lora{rank}{'ff' if ff else ''}w-{rc}"
            impl = "foreach" if rc == "all" else "for-loop"
            n, spec = make(name, fam, cfg, res, batch, "bf16-mixed", rc, impl, tt, frames=frames, lora=rank)
            if ff:
                spec["recipe"]["lora"]["modules"] = FF_TARGETS[fam]
            spec["recipe"]["lora"]["dtype"] = "weight"
            s.append((n, spec))
    return s


def write_specs(specs, spec_dir=SPEC_DIR):
    os.makedirs(spec_dir, exist_ok=True)
    paths = {}
    for name, s in specs:
        p = os.path.join(spec_dir, f"{name}.json")
        with open(p, "w") as f:
            json.dump(s, f, indent=2)
            f.write("\n")
        paths[name] = p
    return paths


def run_peer(path, threads):
    cmd = [sys.executable, os.path.join(HERE, "family_peer.py"), "--spec", path, "--warmup", "1",
           "--steps", "1", "--threads", str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"family_peer failed: {tail}")
    return json.loads(res.stdout)


def estimate(ditmem, path):
    """(peak_bytes, None) or (None, one-line error)."""
    res = subprocess.run([ditmem, "estimate", "--config", path, "--runtime", "pytorch", "--json"],
                         capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        lines = (res.stderr.strip() or res.stdout.strip() or "rejected").splitlines()
        msg = lines[0]
        if "panicked" in msg and len(lines) > 1:  # a Rust panic: its message is the next line
            msg = f"{msg} {lines[1]}"
        return None, msg[:240]
    try:
        return json.loads(res.stdout)["peak_bytes"], None
    except (json.JSONDecodeError, KeyError) as e:
        return None, f"unreadable estimate: {e}"


# One spec per family for runs/<date>-<cpu>-families-saved/families_saved.txt (family_saved.py runs it fp32 and bf16).
SAVED_SPECS = ["dit-fp32-none-loop", "pixart-fp32-none-loop", "sd3-fp32-none-loop",
               "flux-fp32-none-loop", "sana-fp32-none-loop", "wan-fp32-none-loop-f5",
               "flux-bf16-lora4-none-loop"]  # and one LoRA spec: peft's layers


def write_saved(paths, out, threads):
    import family_peer as fp

    v = fp.versions()
    text = [
        "# What autograd saves per segment of one training step of each diffusers family class",
        f"# family_saved.py (saved_tensors_hooks, storages deduplicated by data_ptr), fp32 and bf16 autocast on the CPU;",
        f"# torch {v['torch']}, diffusers {v['diffusers']}, peft {v['peft']}, {threads} threads. Regenerate:",
        "#   bench/torch_peer/.venv/bin/python bench/torch_peer/family_grid.py --saved",
        "# Columns: storage bytes, dtype, shape, producer (grad_fn of the saved tensor), the backward node(s)",
        "# and field that save it, the innermost module running when it was saved. [param]: a parameter",
        "# saved as-is (resident, not in the totals). '(earlier)': a storage first saved by an earlier segment.",
        "",
    ]
    for name in SAVED_SPECS:
        res = subprocess.run([sys.executable, os.path.join(HERE, "family_saved.py"), "--spec", paths[name],
                              "--threads", str(threads)], capture_output=True, text=True, cwd=ROOT)
        if res.returncode != 0:
            raise RuntimeError(f"family_saved.py {name}: {res.stderr.strip().splitlines()[-1:]}")
        text.append(f"## {name} ({os.path.relpath(paths[name], ROOT)})")
        text.append(res.stdout.rstrip())
        text.append("")
        print(f"saved: {name}", file=sys.stderr)
    with open(out, "w") as f:
        f.write("\n".join(text) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ditmem", default=os.path.join(ROOT, "target", "release", "ditmem"))
    ap.add_argument("--out", default=os.path.join(HERE, "runs", time.strftime("%Y-%m-%d", time.gmtime()) + "-" + platform.machine() + "-families", "families.json"))
    ap.add_argument("--only", help="comma-separated spec names")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write-specs-only", action="store_true")
    ap.add_argument("--saved", action="store_true", help="only write runs/<date>-<cpu>-families-saved/families_saved.txt (family_saved.py on one spec per family)")
    ap.add_argument("--no-peer", action="store_true", help="read the measured rows from --out, only estimate")
    ap.add_argument("--estimates-out", help="with --no-peer: write the rows with the new estimates here")
    ap.add_argument("--lora", action="store_true", help="issue 49's LoRA grid (specs/families_lora/, "
                    "runs/<date>-<cpu>-lora-grid/lora_grid.json) instead of the family grid")
    args = ap.parse_args()
    if args.lora:
        specs = lora_grid()
        paths = write_specs(specs, LORA_SPEC_DIR)
        if "-families" in args.out and args.out.endswith("families.json"):
            args.out = args.out.replace("-families", "-lora-grid").replace("families.json", "lora_grid.json")
        print(f"{len(specs)} specs in {os.path.relpath(LORA_SPEC_DIR, ROOT)}", file=sys.stderr)
    else:
        specs = grid()
        paths = write_specs(specs)
        print(f"{len(specs)} specs in {os.path.relpath(SPEC_DIR, ROOT)}", file=sys.stderr)
    if args.write_specs_only:
        return 0
    if args.saved:
        sys.path.insert(0, HERE)
        saved = os.path.join(HERE, "runs", time.strftime("%Y-%m-%d", time.gmtime()) + "-" + platform.machine() + "-families-saved")
        os.makedirs(saved, exist_ok=True)
        write_saved(paths, os.path.join(saved, "families_saved.txt"), args.threads)
        return 0
    names = args.only.split(",") if args.only else [n for n, _ in specs]
    have_ditmem = bool(args.ditmem) and os.path.exists(args.ditmem)
    old = {}
    if args.no_peer or args.only:
        try:
            with open(args.out) as f:
                old = {r["spec"]: r for r in json.load(f)["rows"]}
        except (OSError, ValueError, KeyError):
            old = {}
    rows, last = [], None
    for name in names:
        path = paths[name]
        if args.no_peer:
            row = old[name]
        else:
            t0 = time.perf_counter()
            try:
                peer = run_peer(path, args.threads)
            except RuntimeError as e:
                print(f"{name:40s} {e}", flush=True)
                continue
            last = peer
            c = peer["conditions"]
            row = {
                "spec": name,
                "file": os.path.relpath(path, ROOT),
                "family": c["family"],
                "measured": peer["peak_bytes"],
                "resident": peer["resident_bytes"],
                "phase_peaks": peer["phase_peaks"],
                "params": peer["params"],
                "step_time_s": peer["step_time_s"]["p50"],
                "wall_s": round(time.perf_counter() - t0, 2),
                "conditions": {k: c[k] for k in ("precision", "gradient_checkpointing", "optimizer",
                                                 "optimizer_impl", "lora", "ema", "microbatch", "latent",
                                                 "image_tokens", "text_tokens", "frames")},
            }
        line = (f"{name:40s} meas {row['measured'] / 2**20:8.3f} MiB  resident {row['resident'] / 2**20:7.3f} MiB  "
                f"peak in {max(row['phase_peaks'], key=row['phase_peaks'].get):9s}")
        row.pop("predicted", None)
        row.pop("ratio", None)
        row.pop("estimate_error", None)
        if have_ditmem:
            pred, err = estimate(args.ditmem, path)
            if err:
                row["estimate_error"] = err
                line += f"  ditmem: {err}"
            else:
                row["predicted"] = pred
                row["ratio"] = pred / row["measured"]
                line += f"  pred {pred / 2**20:8.3f} MiB  pred/meas {row['ratio']:.4f}"
        print(line, flush=True)
        rows.append(row)
    if args.only and old:
        merged = {**old, **{r["spec"]: r for r in rows}}
        rows = [merged[n] for n, _ in specs if n in merged]
    errs = [abs(r["ratio"] - 1) for r in rows if "ratio" in r]
    summary = {"specs": len(rows), "estimated": len(errs)}
    if have_ditmem:
        v = subprocess.run([args.ditmem, "--version"], capture_output=True, text=True)
        summary["ditmem"] = {"path": args.ditmem, "version": (v.stdout.strip() or v.stderr.strip())[:120]}
    if errs:
        summary["max_abs_err"] = max(errs)
        summary["median_abs_err"] = statistics.median(errs)
        print(f"\n{len(errs)} of {len(rows)} specs estimated: max |pred/meas − 1| = {max(errs) * 100:.2f} %, "
              f"median = {statistics.median(errs) * 100:.2f} %")
    else:
        print(f"\n{len(rows)} specs measured; none estimated")
    if last is not None:
        c = last["conditions"]
        summary["conditions"] = {k: c[k] for k in ("torch", "diffusers", "peft", "python", "device",
                                                   "device_name", "threads", "omp_wait_policy",
                                                   "attention", "warmup", "steps", "seed")}
        summary["method"] = last["method"]
    elif "summary" in (old or {}):
        pass
    if args.no_peer and args.estimates_out:
        with open(args.estimates_out, "w") as f:
            json.dump({"rows": rows, "summary": {**old.get("__summary__", {}), **summary},
                       "measured_in": os.path.relpath(args.out, ROOT)}, f, indent=2)
            f.write("\n")
    if not args.no_peer:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
