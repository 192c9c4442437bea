#!/usr/bin/env python3
"""What is alive at the measured peak of a family step: every CPU allocation of the profiled
step, paired with its free by address, with the op (and diffusers module) that made it.

    bench/torch_peer/.venv/bin/python bench/torch_peer/family_trace.py --spec S.json \
        [--warmup 1 --threads 2] [--top 40] [--json OUT.json]

Runs the same setup and warm-up as `family_peer.py`, then profiles one step with
`torch.profiler(profile_memory=True)` and reads the allocations from the profiler's event tree
(`kineto_results.experimental_event_tree()`: each allocation has its pointer, signed size and
parent op). The peak (max running sum, the same number `family_peer.py` reports above resident)
is checked against the `[memory]` events `measure.py` reads. Every module's forward runs inside a
`record_function("module::<name>")` range (forward hooks), so an allocation's chain names the
module; backward allocations are named by their autograd node (`evaluate_function: XBackward0`).

Prints: the peak, its phase and op chain, the allocations alive at the peak (largest first), and
the same grouped by (phase, chain). --json writes all allocation events with their running sum.
"""

import argparse
import json
import os
import sys
from collections import OrderedDict

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import family_peer as fp  # noqa: E402
import measure  # noqa: E402


def module_ranges(model):
    """Forward pre/post hooks that open and close a record_function range per module."""
    handles = []
    names = {m: (n or "model") for n, m in model.named_modules()}
    stack = []

    def pre(mod, _args):
        stack.append(torch.ops.profiler._record_function_enter_new(f"module::{names[mod]}", None))

    def post(mod, _args, _out):
        torch.ops.profiler._record_function_exit._RecordFunction(stack.pop())

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    return handles


def chain_of(ev):
    """Names from the outermost ditmem:: / module:: / autograd range down to the allocating op."""
    names = []
    e = ev.parent
    while e is not None:
        names.append(e.name)
        e = e.parent
    names.reverse()
    phase = next((n.split("::", 1)[1] for n in names if n.startswith("ditmem::")), "-")
    keep = [n for n in names if not n.startswith("ditmem::")]
    # The innermost module, the innermost autograd node, and the last two ops.
    mods = [n for n in keep if n.startswith("module::")]
    nodes = [n for n in keep if "evaluate_function:" in n]
    ops = [n for n in keep if n.startswith("aten::") or n.startswith("Optimizer.") or n.startswith("torch::")]
    parts = []
    if mods:
        parts.append(mods[-1][len("module::"):])
    if nodes:
        parts.append(nodes[-1].split("evaluate_function: ", 1)[1])
    parts.extend(ops[-2:] if ops else keep[-1:])
    return phase, " > ".join(parts) if parts else "-"


def allocations(prof):
    from torch._C._profiler import _EventType

    out = []

    def walk(e):
        if e.tag == _EventType.Allocation:
            a = e.extra_fields
            if str(a.device) == "cpu":
                phase, chain = chain_of(e)
                out.append((e.start_time_ns, a.alloc_size, a.ptr, phase, chain))
        for c in e.children:
            walk(c)

    for r in prof.profiler.kineto_results.experimental_event_tree():
        walk(r)
    out.sort(key=lambda x: x[0])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", help="write every allocation event here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fs = fp.load_spec(args.spec)
    tr = fp.FamilyTrainer(fs, torch.device("cpu"), args.seed)
    for _ in range(max(1, args.warmup)):
        tr.step()
    tr.opt.zero_grad(set_to_none=True)
    extra = [tr.inputs.acp] if hasattr(tr.inputs, "acp") else []
    resident = measure.tensor_bytes(measure.resident_tensors(tr.model, tr.opt, tr.ema) + extra)
    hooks = module_ranges(tr.model)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tr.step()
    for h in hooks:
        h.remove()
    # measure.py's number, from the same window.
    kin = prof.profiler.kineto_results.events()
    live = peak_k = 0
    for _ts, n in sorted((e.start_ns(), e.nbytes()) for e in kin if e.name() == "[memory]"):
        live += n
        peak_k = max(peak_k, live)
    allocs = allocations(prof)
    live = peak = 0
    peak_i = -1
    for i, (_t, n, _p, _ph, _c) in enumerate(allocs):
        live += n
        if live > peak:
            peak, peak_i = live, i
    alive = OrderedDict()
    for i, (t, n, ptr, ph, ch) in enumerate(allocs[: peak_i + 1]):
        if n > 0:
            alive[ptr] = (n, ph, ch, i)
        else:
            alive.pop(ptr, None)  # a free (of a block made in the window, or before it: ignored)
    t0 = allocs[0][0] if allocs else 0
    print(f"spec {args.spec}: {fs.family} {fs.precision} recompute={fs.recompute} {fs.optimizer}/{fs.optimizer_impl} lora={bool(fs.lora)} ema={fs.ema}")
    print(f"resident {resident} B; peak above resident {peak} B (measure.py's [memory] events: {peak_k} B"
          f"{'' if peak == peak_k else ' — DIFFERS'}); peak {resident + peak} B")
    if peak_i >= 0:
        _t, n, _p, ph, ch = allocs[peak_i]
        print(f"peak reached at allocation #{peak_i} of {len(allocs)} ({n} B) in phase {ph}: {ch}")
    print(f"\nalive at the peak, made in this step ({sum(v[0] for v in alive.values())} B in {len(alive)} blocks; "
          f"frees of pre-window blocks make the peak smaller than this sum when present), largest first:")
    for n, ph, ch, i in sorted(alive.values(), key=lambda v: -v[0])[: args.top]:
        print(f"  {n:>10d}  #{i:<6d} {ph:9s} {ch}")
    groups = OrderedDict()
    for n, ph, ch, _i in alive.values():
        g = groups.setdefault((ph, ch), [0, 0])
        g[0] += n
        g[1] += 1
    print("\ngrouped by phase and chain:")
    for (ph, ch), (n, k) in sorted(groups.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"  {n:>10d}  ×{k:<4d} {ph:9s} {ch}")
    if args.json:
        run = 0
        rows = []
        for t, n, _ptr, ph, ch in allocs:
            run += n
            rows.append([round((t - t0) / 1000, 3), n, run, ph, ch])
        with open(args.json, "w") as f:
            json.dump({"spec": args.spec, "resident_bytes": resident, "peak_above_resident": peak,
                       "peak_index": peak_i, "columns": ["t_us", "bytes", "running", "phase", "chain"],
                       "events": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
