#!/usr/bin/env python3
"""Predicted (`ditmem estimate --runtime pytorch`) vs measured (the PyTorch peer) peak over a grid
of small specs on the CPU. Prints one row per spec and the max / median |pred/meas − 1|.

    bench/torch_peer/.venv/bin/python bench/torch_peer/grid.py [--ditmem target/release/ditmem]
        [--json OUT.json] [--engine]

`--engine` also runs `ditmem run --json` on each fp32 spec (same threads) and reports the
engine/PyTorch ratios of peak and step time.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

BASE_MODEL = {
    "name": "grid",
    "depth": 4,
    "hidden": 128,
    "heads": 4,
    "patch": 2,
    "in_channels": 4,
    "mlp_ratio": 4,
    "num_classes": 1000,
    "class_dropout_prob": 0.1,
    "learn_sigma": True,
    "freq_embed": 256,
    "attn_dropout": 0.0,
    "mlp_dropout": 0.0,
}


def spec(res, batch, precision, attention, recompute, depth=4, hidden=128, heads=4, ema=True, optimizer="adamw"):
    m = dict(BASE_MODEL, depth=depth, hidden=hidden, heads=heads)
    return {
        "model": m,
        "workload": {
            "height": res,
            "width": res,
            "vae_factor": 8,
            "latent_channels": 4,
            "batch": batch,
            "microbatch": batch,
            "accumulation": 1,
            "ranks": 1,
        },
        "recipe": {
            "precision": precision,
            "optimizer": optimizer,
            "attention": attention,
            "recompute": recompute,
            "lora": None,
            "zero_stage": 0,
            "latents": "cached",
            "ema": {"enabled": ema, "dtype": "f32", "decay": 0.9999},
            "prediction": "eps",
        },
        "runtime": "pytorch:cpu",
    }


def grid():
    out = []
    for precision in ("fp32", "bf16-mixed"):
        for attention in ("memory-efficient", "materialized"):
            for recompute in ("none", "all"):
                for res, batch in ((128, 4), (256, 2)):
                    if precision == "bf16-mixed" and res == 256 and batch == 2:
                        res, batch = 128, 2  # bf16 autocast is slow on this CPU: keep it small
                    out.append(spec(res, batch, precision, attention, recompute))
    # A few more shapes: wider model, deeper model, every-2 checkpointing, SGD without EMA.
    out.append(spec(128, 8, "fp32", "memory-efficient", "none", hidden=192, heads=6))
    out.append(spec(128, 4, "fp32", "materialized", "every-2", depth=6))
    out.append(spec(128, 4, "fp32", "memory-efficient", "none", ema=False, optimizer="sgd"))
    out.append(spec(128, 2, "bf16-mixed", "memory-efficient", "every-2", depth=6))
    # Activation-dominated: larger batches, so the peak sits in backward rather than the optimizer.
    out.append(spec(128, 16, "fp32", "memory-efficient", "none"))
    out.append(spec(128, 16, "fp32", "materialized", "none"))
    out.append(spec(256, 8, "fp32", "memory-efficient", "all"))
    out.append(spec(256, 8, "fp32", "materialized", "every-2"))
    out.append(spec(128, 16, "bf16-mixed", "memory-efficient", "none"))
    out.append(spec(128, 16, "bf16-mixed", "materialized", "none"))
    out.append(spec(128, 16, "bf16-mixed", "memory-efficient", "all"))
    return out


def label(s):
    m, w, r = s["model"], s["workload"], s["recipe"]
    return (
        f"L{m['depth']} D{m['hidden']} {w['height']}px b{w['microbatch']} {r['precision']:10s} "
        f"{'sdpa' if r['attention'] == 'memory-efficient' else 'math':4s} ckpt={r['recompute']:7s} "
        f"{r['optimizer']}{'+ema' if r['ema']['enabled'] else ''} {r.get('optimizer_impl', 'default')}"
    )


def run_json(cmd):
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ditmem", default=os.path.join(ROOT, "target", "release", "ditmem"))
    ap.add_argument("--json", help="write all rows here")
    ap.add_argument("--engine", action="store_true", help="also run `ditmem run` (fp32 specs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--impl",
        choices=["default", "for-loop", "foreach", "both"],
        default="both",
        help="AdamW implementation: the device default (for-loop on the CPU), one, or both in turn",
    )
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        impls = {"both": ["for-loop", "foreach"], "default": [None]}.get(args.impl, [args.impl])
        specs = []
        for imp in impls:
            for s in grid():
                if imp:
                    s["recipe"]["optimizer_impl"] = imp
                specs.append(s)
        for i, s in enumerate(specs):
            path = os.path.join(tmp, f"spec{i}.json")
            with open(path, "w") as f:
                json.dump(s, f)
            est = run_json([args.ditmem, "estimate", "--config", path, "--runtime", "pytorch", "--json"])
            slow = s["recipe"]["precision"] != "fp32"
            peer = run_json(
                [
                    sys.executable,
                    os.path.join(HERE, "peer.py"),
                    "--spec",
                    path,
                    "--warmup",
                    "1",
                    "--steps",
                    "1" if slow else "3",
                    "--threads",
                    str(args.threads),
                ]
            )
            pred, meas = est["peak_bytes"], peer["peak_bytes"]
            row = {
                "spec": label(s),
                "predicted": pred,
                "measured": meas,
                "ratio": pred / meas,
                "predicted_phase": est["peak"]["phase"],
                "measured_phases": peer.get("phase_peaks"),
                "step_p50_s": peer["step_time_s"]["p50"],
            }
            if args.engine and not slow:
                eng = run_json(
                    [args.ditmem, "run", "--config", path, "--runtime", "ditmem-cpu", "--warmup", "1", "--steps", "3", "--threads", str(args.threads), "--json"]
                )
                row["engine"] = eng
            rows.append(row)
            print(
                f"{row['spec']}  pred {pred / 2**20:8.2f} MiB  meas {meas / 2**20:8.2f} MiB  "
                f"pred/meas {row['ratio']:.4f}  ({row['predicted_phase']})",
                flush=True,
            )
    errs = [abs(r["ratio"] - 1) for r in rows]
    summary = {
        "specs": len(rows),
        "max_abs_err": max(errs),
        "median_abs_err": statistics.median(errs),
        "conditions": peer["conditions"] | {"precision": "various", "checkpoint_blocks": "various"},
    }
    print(f"\n{len(rows)} specs: max |pred/meas − 1| = {summary['max_abs_err'] * 100:.2f} %, median = {summary['median_abs_err'] * 100:.2f} %")
    c = peer["conditions"]
    print(f"conditions: torch {c['torch']}, {c['device']} ({c['device_name']}), {c['threads']} threads, OMP_WAIT_POLICY={c['omp_wait_policy']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
