#!/usr/bin/env python3
"""Plan/estimate speed benchmark (issue 46 part 4): a suite of realistic queries run against one
or more ditmem binaries, in alternating rounds, reporting p50/p95 wall and CPU seconds per command
and binary. Not a test: timings depend on the machine and its load, which the run folder records.

usage: run.py OUTDIR LABEL=BINARY [LABEL=BINARY ...] [--rounds N]
Each round runs every query once on every binary (binary order alternates between rounds), so
both see the same load over time. Writes OUTDIR/results.csv (one row per run), OUTDIR/summary.md
and OUTDIR/outputs/<label>/<query>.txt (stdout of the last round, to compare plans).
"""
import csv
import os
import resource
import statistics
import subprocess
import sys
import time

# (name, command, args): families × cards × ranks × allows; every plan on pytorch:cuda (--gpu).
QUERIES = [
    ("est-dit-xl2-256-a100", "estimate", "--preset dit-xl-2 --gpu a100-80gb --batch 128 --precision fp16-mixed --ema on --recompute all"),
    ("est-dit-xl2-512-4090", "estimate", "--preset dit-xl-2 --resolution 512 --batch 32 --gpu rtx-4090"),
    ("est-flux-dev-lora-4090", "estimate", "--preset flux.1-dev --gpu rtx-4090 --lora-rank 16 --base-quant nf4 --recompute all"),
    ("est-sd35m-8r-zero2-a100", "estimate", "--preset sd3.5-medium --ranks 8 --zero 2 --gpu a100-40gb"),
    ("est-sd35l-16r-zero3-h100", "estimate", "--preset sd3.5-large --ranks 16 --zero 3 --gpu h100-sxm --recompute all"),
    ("est-pixart-sigma-l4", "estimate", "--preset pixart-sigma-1024 --gpu l4 --recompute all --optimizer adamw-8bit"),
    ("est-sana-1600m-a10g", "estimate", "--preset sana-1600m --gpu a10g --recompute all"),
    ("est-wan-1.3b-h100", "estimate", "--preset wan2.1-1.3b --gpu h100-sxm --recompute all"),
    ("est-dit-xl2-cpu", "estimate", "--preset dit-xl-2 --runtime ditmem-cpu"),
    ("plan-dit-xl2-512-24g", "plan", "--preset dit-xl-2 --resolution 512 --batch 32 --budget 24GiB --runtime pytorch:cuda"),
    ("plan-dit-xl2-256-a100", "plan", "--preset dit-xl-2 --batch 128 --gpu a100-80gb --ema on"),
    ("plan-dit-b2-t4", "plan", "--preset dit-b-2 --batch 64 --gpu t4"),
    ("plan-dit-xl2-512-3090-4r-all", "plan", "--preset dit-xl-2 --resolution 512 --batch 64 --ranks 4 --gpu rtx-3090 --allow all"),
    ("plan-flux-dev-4090-quant", "plan", "--preset flux.1-dev --gpu rtx-4090 --allow lora,8bit,quant"),
    ("plan-flux-dev-h100-8r-all", "plan", "--preset flux.1-dev --gpu h100-sxm --ranks 8 --allow all"),
    ("plan-flux-schnell-a100-lora", "plan", "--preset flux.1-schnell --gpu a100-40gb --allow lora,8bit"),
    ("plan-sd35m-8r-a100-all", "plan", "--preset sd3.5-medium --ranks 8 --gpu a100-80gb --allow all"),
    ("plan-sd35m-8r-b64-a100-40-all", "plan", "--preset sd3.5-medium --ranks 8 --batch 64 --gpu a100-40gb --allow all"),
    ("plan-sd35m-8r-4090-all", "plan", "--preset sd3.5-medium --ranks 8 --gpu rtx-4090 --allow all"),
    ("plan-sd35l-8r-a100-all", "plan", "--preset sd3.5-large --ranks 8 --gpu a100-80gb --allow all"),
    ("plan-sd3m-a100-40-8bit", "plan", "--preset sd3-medium --resolution 256 --gpu a100-40gb --precision fp16-mixed --allow 8bit"),
    ("plan-pixart-sigma-4090", "plan", "--preset pixart-sigma-1024 --gpu rtx-4090 --batch 4 --allow 8bit"),
    ("plan-pixart-alpha-l4", "plan", "--preset pixart-alpha-1024 --gpu l4 --allow lora,8bit"),
    ("plan-sana-1600m-4090", "plan", "--preset sana-1600m --gpu rtx-4090 --batch 4 --allow 8bit,lora"),
    ("plan-sana-600m-t4", "plan", "--preset sana-600m --gpu t4 --allow all"),
    ("plan-wan-1.3b-4090", "plan", "--preset wan2.1-1.3b --gpu rtx-4090 --allow lora,8bit"),
    ("plan-wan-14b-h100-8r", "plan", "--preset wan2.1-14b --gpu h100-sxm --ranks 8 --allow all"),
    ("plan-dit-xl2-cpu", "plan", "--preset dit-xl-2 --resolution 512 --batch 32 --budget 24GiB --runtime ditmem-cpu"),
]


def run_once(binary, cmd, args):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([binary, cmd] + args.split() + ["--time-limit", "600"] * (cmd == "plan"),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, p.returncode, p.stdout, p.stderr


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def main():
    argv = sys.argv[1:]
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return
    rounds = 3
    if "--rounds" in argv:
        i = argv.index("--rounds")
        rounds = int(argv[i + 1])
        del argv[i:i + 2]
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        sys.exit(__doc__.strip())
    out, bins = argv[0], [a.split("=", 1) for a in argv[1:]]
    os.makedirs(out, exist_ok=True)
    rows = []
    for r in range(rounds):
        order = bins if r % 2 == 0 else list(reversed(bins))
        for name, cmd, args in QUERIES:
            for label, binary in order:
                wall, cpu, rc, so, se = run_once(binary, cmd, args)
                rows.append(dict(round=r, label=label, query=name, command=cmd, rc=rc,
                                 wall_s=f"{wall:.4f}", cpu_s=f"{cpu:.4f}"))
                if r == rounds - 1:
                    d = os.path.join(out, "outputs", label)
                    os.makedirs(d, exist_ok=True)
                    with open(os.path.join(d, name + ".txt"), "w") as f:
                        f.write(f"$ ditmem {cmd} {args}\n# exit {rc}\n{so}{se}")
                print(f"round {r} {label:8} {name:32} rc={rc} wall {wall:7.3f}s cpu {cpu:7.3f}s",
                      flush=True)
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    lines = ["| binary | command | queries | runs | wall p50 | wall p95 | wall max | cpu p50 | cpu p95 | cpu max |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, _ in bins:
        for cmd in ("estimate", "plan"):
            rs = [x for x in rows if x["label"] == label and x["command"] == cmd]
            if not rs:  # a query set without this command (e.g. plans only)
                continue
            wl = [float(x["wall_s"]) for x in rs]
            cp = [float(x["cpu_s"]) for x in rs]
            nq = len({x["query"] for x in rs})
            lines.append(f"| {label} | {cmd} | {nq} | {len(rs)} | {pct(wl, .5):.3f} s | {pct(wl, .95):.3f} s | "
                         f"{max(wl):.3f} s | {pct(cp, .5):.3f} s | {pct(cp, .95):.3f} s | {max(cp):.3f} s |")
    lines += ["", "Per query, median over rounds (wall s / cpu s):", "",
              "| query | " + " | ".join(l for l, _ in bins) + " |",
              "|---|" + "---|" * len(bins)]
    for name, _, _ in QUERIES:
        cells = []
        for label, _ in bins:
            rs = [x for x in rows if x["label"] == label and x["query"] == name]
            cells.append(f"{statistics.median(float(x['wall_s']) for x in rs):.3f} / "
                         f"{statistics.median(float(x['cpu_s']) for x in rs):.3f} (rc {rs[-1]['rc']})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
