#!/usr/bin/env python3
"""`ditmem.torch.measure` (the Python package) against the diffusers peer's own figure.

For each family spec: one process runs `family_peer.run` (its CPU peak: resident tensors + the
profiler's running sum over one step), another builds the same `FamilyTrainer`, warms it up and
hands `tr.step` to `ditmem.torch.measure(..., resident=[model, optimizer, EMA, scheduler table])`.
Both measure one step after the same warm-up with the same seed; the table shows the two peaks
and `ditmem.estimate(config=SPEC)`'s prediction beside them.

    bench/torch_peer/.venv/bin/python bench/torch_peer/python_api_vs_peer.py SPEC.json [...]

Needs the peer venv with diffusers (setup_diffusers.sh) and the ditmem package installed into it
(`pip install target/wheels/ditmem-*.whl`).
"""

import json
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))


def child(mode: str, spec: str) -> dict:
    sys.path.insert(0, here)
    import torch  # noqa: PLC0415

    import family_peer  # noqa: PLC0415

    torch.set_num_threads(2)
    if mode == "peer":
        args = family_peer.argparse.Namespace(
            spec=spec, warmup=1, steps=1, threads=2, seed=0, snapshot=None,
            snapshot_max_entries=0,
        )
        out = family_peer.run(args)
        return {"peak_bytes": out["peak_bytes"], "resident_bytes": out["resident_bytes"]}
    import ditmem.torch as dmt  # noqa: PLC0415

    fs = family_peer.load_spec(spec)
    tr = family_peer.FamilyTrainer(fs, torch.device("cpu"), 0)
    tr.step()  # the peer's warm-up
    tr.opt.zero_grad(set_to_none=True)
    extra = [tr.inputs.acp] if hasattr(tr.inputs, "acp") else []
    m = dmt.measure(tr.step, warmup=0, steps=1, device="cpu",
                    resident=[tr.model, tr.opt, tr.ema, extra])
    return m.to_dict()


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] in ("peer", "api"):
        print(json.dumps(child(sys.argv[1], sys.argv[2])))
        return 0
    import ditmem  # noqa: PLC0415

    print(f"{'spec':<34} {'ditmem.torch':>14} {'peer':>14} {'equal':>6} {'estimate':>14} {'pred/meas':>9}")
    for spec in sys.argv[1:]:
        res = {}
        for mode in ("api", "peer"):
            p = subprocess.run([sys.executable, __file__, mode, spec], capture_output=True, text=True)
            if p.returncode != 0:
                print(f"{os.path.basename(spec)}: {mode} failed: {p.stderr.strip().splitlines()[-1:]}")
                break
            res[mode] = json.loads(p.stdout.strip().splitlines()[-1])
        else:
            est = ditmem.estimate(config=spec)
            a, b = res["api"]["peak_bytes"], res["peer"]["peak_bytes"]
            print(f"{os.path.basename(spec):<34} {a:>14,} {b:>14,} {str(a == b):>6} "
                  f"{est.peak_bytes:>14,} {est.peak_bytes / a:>9.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
