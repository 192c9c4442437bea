#!/usr/bin/env python3
"""The ditmem engine (`ditmem run`) and the diffusers peer (`family_peer.py`) side by side on the
same family specs, same threads, in alternating rounds: per spec the step peak above the resident
state and the step time p50 of both, and their ratios engine / peer (median over rounds, with the
range of the per-round time ratios). Nothing is asserted; conditions are printed.

    bench/torch_peer/.venv/bin/python bench/torch_peer/family_side_by_side.py \
        --spec A.json --spec B.json [--rounds 3 --steps 5 --threads 2 --ditmem target/release/ditmem]

A spec is the `spec` object of `ditmem estimate --json` (model.diffusers, workload, recipe).

What each step peak counts (both: the bytes above what lives between steps, at the step's worst
moment):
- engine: `ditmem run --json` peak_bytes − resident_bytes, from the counting allocator (every heap
  byte: tensors, candle's per-tensor bookkeeping, the gradient store). resident_bytes is read just
  before the step, so it holds the weights, optimizer state, EMA, the step's batch (f64 latents,
  noise and text embeddings, drawn before the step) and the `gemm` crate's packing slabs
  (threads × L2 bytes, thread-locals made in the warm-up step and kept): neither is in the step
  peak.
- peer: `family_peer.py` step_peak_above_resident, torch's profiler [memory] events (storages of
  c10's CPU allocator only). The inputs the step draws (latents, noise, text embeddings in the
  weight dtype) are made inside the step and counted; MKL's and oneDNN's packing buffers
  (mkl_malloc, kept across calls like the gemm slabs) and autograd's node objects are not
  tracked at all: neither side's step peak holds packing memory.
Per row the engine's worst moment and what is live at it above the step start come from
`ditmem estimate --json` (`peak.label`, `peak.breakdown` − the first timeline event; the budget
agrees with the engine to < 1 %), the peer's from its phase peaks.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def p50(t):
    if isinstance(t, dict):
        return t["p50"]
    return statistics.median(t)


def engine(ditmem, spec, steps, threads):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run(
        [ditmem, "run", "--config", spec, "--steps", str(steps), "--json"],
        env=env, capture_output=True, text=True, check=True,
    )
    v = json.loads(out.stdout)
    return v["peak_bytes"] - v["resident_bytes"], p50(v["step_time_s"])


def engine_peak_moment(ditmem, spec):
    """The budget's worst moment of the engine's step: its label and the bytes live at it above
    the step start, by kind (activations, workspace, gradients, data, runtime, ...)."""
    out = subprocess.run([ditmem, "estimate", "--config", spec, "--json"],
                         capture_output=True, text=True, check=True)
    v = json.loads(out.stdout)
    start = v["timeline"]["events"][0]["live"]
    at = v["peak"]["breakdown"]
    above = {k: at[k] - start[k] for k in at if at[k] != start[k]}
    return v["peak"]["label"], above


def peer(python, spec, steps, threads):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run(
        [python, os.path.join(HERE, "family_peer.py"), "--spec", spec,
         "--steps", str(steps), "--threads", str(threads)],
        env=env, capture_output=True, text=True, check=True,
    )
    v = json.loads(out.stdout[out.stdout.index("{"):])
    phases = v["phase_peaks"]
    return (v["step_peak_above_resident"], p50(v["step_time_s"]), v["conditions"],
            max(phases, key=phases.get))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ditmem", default=os.path.join(ROOT, "target", "release", "ditmem"))
    ap.add_argument("--python", default=sys.executable)
    a = ap.parse_args()
    rows = []
    cond = None
    for spec in a.spec:
        e_peak, e_t, p_peak, p_t = [], [], [], []
        for _ in range(a.rounds):
            ep, et = engine(a.ditmem, spec, a.steps, a.threads)
            pp, pt, cond, p_phase = peer(a.python, spec, a.steps, a.threads)
            e_peak.append(ep)
            e_t.append(et)
            p_peak.append(pp)
            p_t.append(pt)
        ratios = [x / y for x, y in zip(e_t, p_t)]
        label, above = engine_peak_moment(a.ditmem, spec)
        rows.append({
            "spec": os.path.basename(spec),
            "engine_step_peak": statistics.median(e_peak),
            "peer_step_peak": statistics.median(p_peak),
            "peak_ratio": statistics.median(e_peak) / statistics.median(p_peak),
            "engine_p50_s": statistics.median(e_t),
            "peer_p50_s": statistics.median(p_t),
            "time_ratio": statistics.median(e_t) / statistics.median(p_t),
            "time_ratio_range": [min(ratios), max(ratios)],
            "engine_peak_at": label,
            "engine_peak_above_start": above,
            "peer_peak_phase": p_phase,
        })
    print(json.dumps({"rows": rows, "rounds": a.rounds, "steps": a.steps,
                      "threads": a.threads, "peer_conditions": cond}, indent=1))
    print(f"{'spec':40} {'engine peak':>12} {'peer peak':>12} {'ratio':>6} "
          f"{'engine p50':>10} {'peer p50':>9} {'ratio':>6}", file=sys.stderr)
    for r in rows:
        print(f"{r['spec']:40} {r['engine_step_peak']:>12,} {r['peer_step_peak']:>12,} "
              f"{r['peak_ratio']:>6.2f} {r['engine_p50_s']:>10.4f} {r['peer_p50_s']:>9.4f} "
              f"{r['time_ratio']:>6.2f}", file=sys.stderr)
    print("engine's worst moment (budget) and what is live at it above the step start; the "
          "peer's phase:", file=sys.stderr)
    for r in rows:
        parts = ", ".join(f"{k} {v:,}" for k, v in sorted(r["engine_peak_above_start"].items(),
                                                          key=lambda kv: -kv[1]))
        print(f"{r['spec']:40} {r['engine_peak_at']:24} {parts}; peer: {r['peer_peak_phase']}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
