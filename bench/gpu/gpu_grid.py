#!/usr/bin/env python3
"""The GPU kit's grid: real training steps of the real diffusers classes (gpu_step.py, one
process per row) beside `ditmem estimate --runtime pytorch:cuda --gpu <card> --json`; prints the
table (predicted / measured allocated, reserved, device) with max and median |error| per family
and per recipe kind, and writes everything under --out. `--cpu`: the same recipe kinds on tiny
specs on the CPU against `--runtime pytorch:cpu` (the kit's plumbing, end to end, without a GPU).

    python bench/gpu/gpu_grid.py --out DIR [--cpu] [--ditmem PATH] [--budget-s 420] [--only a,b]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench", "torch_peer"))

# torch.cuda.get_device_name → ditmem's GPU table (`ditmem gpus`).
CARDS = [("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("A100-SXM4-80GB", "a100-80gb"),
         ("A100 80GB", "a100-80gb"), ("A100-SXM4-40GB", "a100-40gb"), ("A100-PCIE-40GB", "a100-40gb"),
         ("L40S", "l40s"), ("A10G", "a10g"), ("L4", "l4"), ("RTX 4090", "rtx-4090"), ("RTX 3090", "rtx-3090"),
         ("RTX 5090", "rtx-5090"), ("RTX A6000", "rtx-a6000"), ("T4", "t4")]

FF = {"flux": "to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,proj_mlp"}


def card_of(torch_name: str):
    for needle, name in CARDS:
        if needle in torch_name:
            return name
    return None


def row(name, preset, res, batch, precision, recompute, impl="foreach", lora=None, optimizer="adamw",
        base_quant=None, frames=None, expandable=False, snapshot=False, depth=None):
    """One row: the `ditmem spec` flags that make its spec, and what the kit adds."""
    flags = ["--preset", preset, "--resolution", str(res), "--batch", str(batch), "--precision", precision,
             "--recompute", recompute, "--optimizer", optimizer, "--optimizer-impl", impl,
             "--attention", "memory-efficient", "--ema", "off"]
    if lora:
        flags += ["--lora-rank", str(lora)]
    if base_quant:
        flags += ["--base-quant", base_quant]
    if frames:
        flags += ["--frames", str(frames)]
    kind = "lora" if lora else ("full")
    kind += f"/{precision}"
    if optimizer != "adamw":
        kind += f"/{optimizer}"
    if base_quant:
        kind += f"/{base_quant}"
    return {"name": name, "flags": flags, "kind": kind, "expandable": expandable, "snapshot": snapshot,
            "depth": depth}


def cuda_rows():
    """Sized for about 8 minutes on one H100 (80 GB): one process per row."""
    flux_depth = (4, 8)  # FLUX.1-dev at real width (3072), 4 double + 8 single blocks of 19 + 38
    return [
        row("dit-xl2-512-fp32", "dit-xl-2-512", 512, 8, "fp32", "none"),
        row("dit-xl2-512-bf16", "dit-xl-2-512", 512, 8, "bf16-mixed", "none", snapshot=True),
        row("dit-xl2-512-bf16-ckpt-fused", "dit-xl-2-512", 512, 16, "bf16-mixed", "all", impl="fused"),
        row("dit-xl2-512-bf16-expseg", "dit-xl-2-512", 512, 8, "bf16-mixed", "none", expandable=True),
        row("pixart-s-512-bf16", "pixart-sigma-1024", 512, 4, "bf16-mixed", "none"),
        row("pixart-s-1024-bf16-ckpt-fused", "pixart-sigma-1024", 1024, 2, "bf16-mixed", "all", impl="fused"),
        row("pixart-s-1024-pure-ckpt", "pixart-sigma-1024", 1024, 2, "bf16-pure", "all"),
        row("pixart-s-1024-lora16", "pixart-sigma-1024", 1024, 2, "bf16-mixed", "none", lora=16),
        row("sd3m-512-fp32-ckpt", "sd3-medium", 512, 1, "fp32", "all"),
        row("sd3m-512-bf16-ckpt", "sd3-medium", 512, 2, "bf16-mixed", "all"),
        row("sd3m-1024-lora16", "sd3-medium", 1024, 1, "bf16-mixed", "none", lora=16, snapshot=True),
        row("sd3m-512-bf16-ckpt-8bit", "sd3-medium", 512, 2, "bf16-mixed", "all", optimizer="adamw-8bit"),
        row("sd3m-1024-bf16-ckpt-fused-expseg", "sd3-medium", 1024, 1, "bf16-mixed", "all", impl="fused",
            expandable=True),
        row("flux12-512-lora16-ckpt", "flux.1-dev", 512, 1, "bf16-mixed", "all", lora=16, depth=flux_depth,
            snapshot=True),
        row("flux12-1024-lora16", "flux.1-dev", 1024, 1, "bf16-mixed", "none", lora=16, depth=flux_depth),
        row("flux12-1024-lora16-nf4-ckpt", "flux.1-dev", 1024, 1, "bf16-mixed", "all", lora=16, base_quant="nf4",
            depth=flux_depth),
        row("flux12-512-pure-ckpt", "flux.1-dev", 512, 1, "bf16-pure", "all", depth=flux_depth),
        row("sana600m-1024-bf16", "sana-600m", 1024, 4, "bf16-mixed", "none"),
        row("sana600m-1024-fp32-ckpt-fused", "sana-600m", 1024, 4, "fp32", "all", impl="fused"),
        row("sana600m-1024-lora16", "sana-600m", 1024, 4, "bf16-mixed", "none", lora=16),
        row("wan13-480-f9-bf16-ckpt", "wan2.1-1.3b", 480, 1, "bf16-mixed", "all", frames=9),
        row("wan13-480-f5-lora16", "wan2.1-1.3b", 480, 1, "bf16-mixed", "none", lora=16, frames=5),
        row("wan13-480-f9-pure-ckpt-fused-expseg", "wan2.1-1.3b", 480, 1, "bf16-pure", "all", impl="fused",
            frames=9, expandable=True),
    ]


def cpu_rows():
    """The recipe kinds of cuda_rows() that run on the CPU, on family_grid.py's tiny configs."""
    return [
        ("dit-fp32-none", "dit", "fp32", "none", "foreach", None),
        ("pixart-bf16-ckpt", "pixart", "bf16-mixed", "all", "foreach", None),
        ("sd3-bf16-lora8", "sd3", "bf16-mixed", "none", "for-loop", 8),
        ("flux-bf16-lora8-ckpt", "flux", "bf16-mixed", "all", "foreach", 8),
        ("sana-fp32-ckpt", "sana", "fp32", "all", "for-loop", None),
        ("wan-bf16-lora4", "wan", "bf16-mixed", "none", "foreach", 4),
    ]


def tiny_specs(out_dir):
    import family_grid as fg

    cfg = {"dit": (fg.dit_cfg(16), 128, 2, None, 1), "pixart": (fg.pixart_cfg(16), 128, 2, [120], 1),
           "sd3": (fg.sd3_cfg(16), 128, 2, [77, 77], 1), "flux": (fg.flux_cfg(), 128, 2, [77, 128], 1),
           "sana": (fg.sana_cfg(8), 256, 2, [300], 1), "wan": (fg.wan_cfg(), 64, 2, [512], 5)}
    rows = []
    for name, fam, prec, rc, impl, lora in cpu_rows():
        c, res, b, tt, frames = cfg[fam]
        _, spec = fg.make(name, fam, c, res, b, prec, rc, impl, tt, frames=frames, lora=lora)
        path = os.path.join(out_dir, "specs", f"{name}.json")
        with open(path, "w") as f:
            json.dump(spec, f, indent=2)
        kind = ("lora" if lora else "full") + f"/{prec}"
        rows.append({"name": name, "path": path, "kind": kind, "family": fam, "expandable": False,
                     "snapshot": False})
    return rows


def make_cuda_spec(ditmem, r, out_dir, card):
    res = subprocess.run([ditmem, "spec", "--json", *r["flags"], "--runtime", "pytorch:cuda", "--gpu", card],
                         capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"ditmem spec: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
    spec = json.loads(res.stdout)
    if r["depth"]:
        double, single = r["depth"]
        spec["model"]["diffusers"]["num_layers"] = double
        spec["model"]["diffusers"]["num_single_layers"] = single
        spec["model"]["depth"] = double + single
    if r["name"].startswith("flux") and "lora" in r["kind"]:
        spec["recipe"]["lora"]["modules"] = FF["flux"].split(",")
    if r["expandable"]:
        spec.setdefault("cuda", {})["alloc_conf"] = "expandable_segments:True"
    path = os.path.join(out_dir, "specs", f"{r['name']}.json")
    with open(path, "w") as f:
        json.dump(spec, f, indent=2)
    return path


def estimate(ditmem, path, runtime, card=None, expandable=False):
    cmd = [ditmem, "estimate", "--config", path, "--runtime", runtime, "--json"]
    if card:
        cmd += ["--gpu", card]
    if expandable:
        cmd += ["--alloc-conf", "expandable_segments:True"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        return None, (res.stderr.strip().splitlines() or ["rejected"])[0][:200]
    return json.loads(res.stdout), None


def err(p, m):
    return None if not p or not m else p / m - 1


def summarize(rows, key):
    out = {}
    for group in ("family", "kind"):
        for g in sorted({r[group] for r in rows}):
            e = [abs(r[key]) for r in rows if r[group] == g and r.get(key) is not None]
            if e:
                out[f"{group}={g}"] = {"rows": len(e), "max": max(e), "median": statistics.median(e)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--ditmem", default=os.path.join(ROOT, "target", "release", "ditmem"))
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no row after this many seconds")
    ap.add_argument("--only", help="comma-separated row names")
    args = ap.parse_args()
    os.makedirs(os.path.join(args.out, "specs"), exist_ok=True)
    os.makedirs(os.path.join(args.out, "rows"), exist_ok=True)
    t_start = time.time()
    py = sys.executable
    card = None
    if args.cpu:
        rows = tiny_specs(args.out)
        device = "cpu"
    else:
        import torch

        if not torch.cuda.is_available():
            print("gpu_grid: CUDA is not available (use --cpu)", file=sys.stderr)
            return 2
        tname = torch.cuda.get_device_name(0)
        card = card_of(tname)
        if card is None:
            print(f"gpu_grid: '{tname}' is not in ditmem's GPU table (ditmem gpus)", file=sys.stderr)
            return 2
        device = "cuda"
        rows = []
        for r in cuda_rows():
            r["family"] = r["flags"][1].split("-")[0].split(".")[0].replace("wan2", "wan")
            try:
                r["path"] = make_cuda_spec(args.ditmem, r, args.out, card)
            except RuntimeError as e:
                r["error"] = str(e)
            rows.append(r)
    if args.only:
        keep = set(args.only.split(","))
        rows = [r for r in rows if r["name"] in keep]
    results = []
    for r in rows:
        res = {"name": r["name"], "family": r["family"], "kind": r["kind"] + ("/expseg" if r["expandable"] else ""),
               "spec": os.path.relpath(r.get("path", ""), args.out) if r.get("path") else None}
        results.append(res)
        if "error" in r:
            res["error"] = r["error"]
            print(f"{r['name']:40s} {r['error']}", flush=True)
            continue
        if time.time() - t_start > args.budget_s:
            res["error"] = f"not run: the grid's time budget ({args.budget_s:.0f} s) was spent"
            print(f"{r['name']:40s} {res['error']}", flush=True)
            continue
        env = dict(os.environ)
        if r["expandable"]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        else:
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        cmd = [py, os.path.join(HERE, "gpu_step.py"), "--spec", r["path"], "--device", device]
        if r["snapshot"]:
            cmd += ["--snapshot", os.path.join(args.out, "rows", f"{r['name']}.pickle")]
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        res["wall_s"] = round(time.time() - t0, 1)
        with open(os.path.join(args.out, "rows", f"{r['name']}.stderr.txt"), "w") as f:
            f.write(p.stderr)
        if p.returncode != 0:
            res["error"] = "gpu_step: " + ((p.stderr.strip().splitlines() or ["?"])[-1])[:200]
            print(f"{r['name']:40s} {res['error']}", flush=True)
            continue
        m = json.loads(p.stdout)
        with open(os.path.join(args.out, "rows", f"{r['name']}.json"), "w") as f:
            json.dump(m, f, indent=2)
        res["measured"] = m
        est, e = estimate(args.ditmem, r["path"], "pytorch:cpu" if args.cpu else "pytorch:cuda", card,
                          r["expandable"])
        if e:
            res["estimate_error"] = e
            print(f"{r['name']:40s} measured; ditmem: {e}", flush=True)
            continue
        res["params_match"] = (est["params"]["total"] == m["params"]["total"]
                               and est["params"]["trained"] == m["params"]["trained"])
        if args.cpu:
            res["pred_peak"], res["meas_peak"] = est["peak_bytes"], m["peak_bytes"]
            res["err_alloc"] = err(est["peak_bytes"], m["peak_bytes"])
        else:
            c = est["cuda"]
            res["pred_alloc"], res["meas_alloc"] = c["max_allocated_bytes"], m["max_allocated"]
            res["pred_reserved"], res["meas_reserved"] = c["max_reserved_bytes"], m["max_reserved"]
            res["pred_device"] = c["device_bytes"]
            res["meas_device"] = m["nvidia_smi_used"] or m["mem_get_info"]["used_by_process"]
            res["err_alloc"] = err(res["pred_alloc"], res["meas_alloc"])
            res["err_reserved"] = err(res["pred_reserved"], res["meas_reserved"])
            res["err_device"] = err(res["pred_device"], res["meas_device"])
            res["p50_s"] = m["step_time_p50_s"]
        print(f"{r['name']:40s} {line(res, args.cpu)}", flush=True)
    keys = ["err_alloc"] if args.cpu else ["err_alloc", "err_reserved", "err_device"]
    summary = {k: summarize(results, k) for k in keys}
    table = render(results, summary, args.cpu)
    print("\n" + table)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table + "\n")
    conditions = {"device": device, "card": card, "python": platform.python_version(),
                  "host": platform.node(), "elapsed_s": round(time.time() - t_start, 1),
                  "ditmem": subprocess.run([args.ditmem, "--version"], capture_output=True, text=True).stdout.strip()}
    try:
        import torch

        conditions["torch"] = torch.__version__
        conditions["cuda"] = torch.version.cuda
        if not args.cpu:
            conditions["device_name"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"rows": results, "summary": summary, "conditions": conditions}, f, indent=2)
    measured = [r for r in results if "measured" in r]
    if not measured:
        print("gpu_grid: no row was measured", file=sys.stderr)
        return 1
    return 0


def mib(x):
    return "-" if x is None else f"{x / 2**20:.1f}"


def pct(x):
    return "-" if x is None else f"{100 * x:+.2f} %"


def line(r, cpu):
    if cpu:
        return f"pred {mib(r['pred_peak'])} MiB meas {mib(r['meas_peak'])} MiB  {pct(r['err_alloc'])}"
    return (f"alloc {mib(r['pred_alloc'])}/{mib(r['meas_alloc'])} MiB {pct(r['err_alloc'])}  reserved "
            f"{pct(r['err_reserved'])}  device {pct(r['err_device'])}  p50 {r['p50_s']:.3f} s")


def render(results, summary, cpu):
    if cpu:
        head = "| row | kind | predicted MiB | measured MiB | error | params equal |\n|---|---|---:|---:|---:|---|"
    else:
        head = ("| row | kind | alloc pred / meas MiB | err | reserved pred / meas MiB | err | device pred / meas MiB "
                "| err | p50 s | params equal |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    out = [head]
    for r in results:
        if "err_alloc" not in r:
            out.append(f"| {r['name']} | {r['kind']} | {r.get('error') or r.get('estimate_error')} |")
            continue
        if cpu:
            out.append(f"| {r['name']} | {r['kind']} | {mib(r['pred_peak'])} | {mib(r['meas_peak'])} | "
                       f"{pct(r['err_alloc'])} | {r['params_match']} |")
        else:
            out.append(f"| {r['name']} | {r['kind']} | {mib(r['pred_alloc'])} / {mib(r['meas_alloc'])} | "
                       f"{pct(r['err_alloc'])} | {mib(r['pred_reserved'])} / {mib(r['meas_reserved'])} | "
                       f"{pct(r['err_reserved'])} | {mib(r['pred_device'])} / {mib(r['meas_device'])} | "
                       f"{pct(r['err_device'])} | {r['p50_s']:.3f} | {r['params_match']} |")
    out.append("")
    for k, groups in summary.items():
        out.append(f"|{k}| rows | max abs | median abs |\n|---|---:|---:|---:|")
        for g, s in groups.items():
            out.append(f"| {g} | {s['rows']} | {100 * s['max']:.2f} % | {100 * s['median']:.2f} % |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
