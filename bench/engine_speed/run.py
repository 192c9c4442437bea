#!/usr/bin/env python3
"""Step time of the candle engine, two or more release binaries side by side.

A benchmark, not a test: every spec runs `ditmem run --json` once per binary per round, the
binaries' order flipping each round so both see the same load of a shared machine. Each run
reports its own step-time p50/p95/p99 over `--steps` measured steps after `--warmup`; this
script keeps, per spec and binary, the median over the rounds of each of those, their ratio to
the first binary, and the peak bytes (which must not move between two builds of the same rules:
a difference is printed as such).

    python3 bench/engine_speed/run.py OUTDIR base=/path/to/old/ditmem new=target/release/ditmem

OUTDIR receives every run's JSON (`raw/<round>-<binary>-<spec>.json`), `summary.json` and
`summary.txt`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "bench/torch_peer/specs/engine_families"

# Real-width cases: one block of each family's preset at 256², the engine's ops at the widths
# users train (Flux is left out: one block pair at its width is 20 s a step here).
REAL = {
    "pixart-alpha-1024-d1-256-bf16": ["--preset", "pixart-alpha-1024", "--precision", "bf16-mixed"],
    "pixart-alpha-1024-d1-256-fp32": ["--preset", "pixart-alpha-1024", "--precision", "fp32"],
    "sd3-medium-d1-256-bf16": ["--preset", "sd3-medium", "--precision", "bf16-mixed"],
    "sana-600m-d1-256-bf16": ["--preset", "sana-600m", "--precision", "bf16-mixed"],
    "wan2.1-1.3b-f1-d1-256-bf16": ["--preset", "wan2.1-1.3b", "--frames", "1", "--precision", "bf16-mixed"],
}
REAL_COMMON = ["--depth", "1", "--resolution", "256"]


def cases(args):
    out = {}
    if not args.real_only:
        for p in sorted(TINY.glob("*.json")):
            out[p.stem] = ["--config", str(p), "--steps", str(args.steps), "--warmup", "2"]
    if not args.tiny_only:
        for name, flags in REAL.items():
            out[name] = REAL_COMMON + flags + ["--steps", str(args.real_steps), "--warmup", "1"]
    return out


def run_one(binary, flags, out_file):
    t0 = time.perf_counter()
    proc = subprocess.run(
        [binary, "run", *flags, "--json", "--out", str(out_file)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"{binary} run {' '.join(flags)}: exit {proc.returncode}: {proc.stderr.strip()}")
    d = json.loads(out_file.read_text())
    return {
        "wall_s": time.perf_counter() - t0,
        "p50": d["step_time_s"]["p50"],
        "p95": d["step_time_s"]["p95"],
        "p99": d["step_time_s"]["p99"],
        "peak_bytes": d["peak_bytes"],
        "conditions": d["conditions"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("binaries", nargs="+", help="NAME=PATH, the first is the reference")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="measured steps of a tiny spec")
    ap.add_argument("--real-steps", type=int, default=5, help="measured steps of a real-width case")
    ap.add_argument("--tiny-only", action="store_true")
    ap.add_argument("--real-only", action="store_true")
    args = ap.parse_args()
    bins = [b.split("=", 1) for b in args.binaries]
    if any(len(b) != 2 for b in bins):
        sys.exit("binaries are NAME=PATH")
    outdir = Path(args.outdir)
    (outdir / "raw").mkdir(parents=True, exist_ok=True)
    todo = cases(args)
    runs = {}  # (spec, name) -> [result per round]
    for r in range(args.rounds):
        order = bins if r % 2 == 0 else bins[::-1]
        for spec, flags in todo.items():
            for name, path in order:
                res = run_one(path, flags, outdir / "raw" / f"{r}-{name}-{spec}.json")
                runs.setdefault((spec, name), []).append(res)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    ref = bins[0][0]
    rows = []
    for spec in todo:
        row = {"spec": spec}
        for name, _ in bins:
            rs = runs[(spec, name)]
            row[name] = {q: statistics.median(x[q] for x in rs) for q in ("p50", "p95", "p99")}
            row[name]["peak_bytes"] = sorted({x["peak_bytes"] for x in rs})
        for name, _ in bins[1:]:
            row[f"{name}/{ref}"] = {
                q: row[name][q] / row[ref][q] for q in ("p50", "p95", "p99")
            }
        rows.append(row)
    first = runs[(next(iter(todo)), ref)][0]["conditions"]
    conditions = {
        k: first[k]
        for k in ("cpu_model", "cores", "threads", "build_profile", "candle_version", "bf16_products", "malloc")
        if k in first
    }
    conditions.update(
        rounds=args.rounds,
        steps_tiny=args.steps,
        steps_real=args.real_steps,
        load_average_end=os.getloadavg(),
        binaries={name: {"path": path, "git_revision": runs[(next(iter(todo)), name)][0]["conditions"].get("git_revision")} for name, path in bins},
    )
    summary = {"conditions": conditions, "rows": rows}
    for name, _ in bins[1:]:
        key = f"{name}/{ref}"
        summary[f"geomean {key}"] = {
            q: statistics.geometric_mean(r[key][q] for r in rows) for q in ("p50", "p95", "p99")
        }
    (outdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"conditions: {json.dumps(conditions)}", ""]
    head = f"{'spec':40}" + "".join(f"{n + ' p50 ms':>14}" for n, _ in bins)
    head += "".join(f"{n + '/' + ref + ' p50':>16}{'p95':>7}{'p99':>7}" for n, _ in bins[1:]) + "  peak"
    lines.append(head)
    for row in rows:
        line = f"{row['spec']:40}" + "".join(f"{row[n]['p50'] * 1e3:14.2f}" for n, _ in bins)
        for n, _ in bins[1:]:
            q = row[f"{n}/{ref}"]
            line += f"{q['p50']:16.3f}{q['p95']:7.3f}{q['p99']:7.3f}"
        peaks = {n: row[n]["peak_bytes"] for n, _ in bins}
        same = all(p == peaks[ref] for p in peaks.values()) and len(peaks[ref]) == 1
        line += "  same" if same else f"  DIFFERS {peaks}"
        lines.append(line)
    for name, _ in bins[1:]:
        g = summary[f"geomean {name}/{ref}"]
        lines.append(f"geomean {name}/{ref}: p50 {g['p50']:.3f}, p95 {g['p95']:.3f}, p99 {g['p99']:.3f}")
    (outdir / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
