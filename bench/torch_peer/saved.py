#!/usr/bin/env python3
"""List what autograd saves for backward in one DiT block (or the embedder / final layer), with
the producing op, shape, dtype and storage bytes: the ground truth behind the budget's `pytorch`
runtime rules.

    .venv/bin/python saved.py --spec FILE.json [--segment block|embed|final]
"""

import argparse
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dit import DiT  # noqa: E402
from spec import load  # noqa: E402


def record(fn):
    """Run fn() with saved-tensor hooks; returns the saved tensors' storages (unique), in order."""
    seen = {}
    order = []

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in seen:
            gf = t.grad_fn.name() if t.grad_fn is not None else ("param" if t.requires_grad else "leaf")
            seen[key] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), st.nbytes(), gf)
            order.append(key)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return [seen[k] for k in order], out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--segment", default="block", choices=["block", "embed", "final", "model"])
    args = ap.parse_args()
    ps = load(args.spec)
    m = ps.model
    model = DiT(m, ps.latent_h, ps.latent_w, ps.fused_attention, [])
    if ps.precision == "fp64":
        model.double()
    dt = torch.float64 if ps.precision == "fp64" else torch.float32
    ac = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(ps.precision)
    b = ps.microbatch
    s = (ps.latent_h // m["patch"]) * (ps.latent_w // m["patch"])
    d = m["hidden"]
    x = torch.randn(b, s, d, dtype=dt, requires_grad=True)
    c = torch.randn(b, d, dtype=dt, requires_grad=True)
    lat = torch.randn(b, m["in_channels"], ps.latent_h, ps.latent_w, dtype=dt)
    t = torch.randint(0, 1000, (b,))
    y = torch.randint(0, m["num_classes"], (b,))

    def fn():
        with torch.autocast("cpu", dtype=ac, enabled=ac is not None):
            if args.segment == "block":
                return model.blocks[0](x, c)
            if args.segment == "final":
                return model.final_layer(x, c)
            if args.segment == "embed":
                return model.x_embedder(lat) + model.pos_embed, model.t_embedder(t) + model.y_embedder(y)
            return model(lat, t, y)

    saved, _ = record(fn)
    e = b * s * d
    total = 0
    for shape, dtype, nbytes, gf in saved:
        total += nbytes
        print(f"{gf:28s} {str(shape):28s} {dtype:9s} {nbytes:>12d}  {nbytes / e:6.2f} E-bytes")
    print(f"total {total} bytes = {total / e:.3f} bytes per E (E = b·s·D = {e})")


if __name__ == "__main__":
    main()
