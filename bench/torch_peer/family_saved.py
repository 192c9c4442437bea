#!/usr/bin/env python3
"""What autograd saves for backward in one training step of a diffusers family class, per block:
the ground truth behind the `pytorch` runtime's family rules.

    bench/torch_peer/.venv/bin/python bench/torch_peer/family_saved.py --spec S.json \
        [--precision fp32,bf16-mixed] [--all-tensors]

Runs the forward and loss of `family_peer.py`'s step (same inputs, same model setup, gradient
checkpointing forced off) under `torch.autograd.graph.saved_tensors_hooks`. Every saved tensor is
deduplicated by its storage (`untyped_storage().data_ptr()`; all saved storages stay alive until
backward, so the key is unique) and counted with its storage's bytes, attributed to the *segment*
running when it was first saved: a top-level submodule of the model (`pos_embed`,
`time_text_embed`, `context_embedder`, `norm_out`, `proj_out`, ...), one element of a top-level
ModuleList (`transformer_blocks.0`, `single_transformer_blocks.1`, ...), `model body` (the
model's own forward between submodules) or `step` (outside the model: noising, loss). A storage
that later segments save again (the projected text context read by every block's cross-attention,
RoPE cos/sin, the timestep embedding) counts in the first; the later ones list it as "(earlier)"
and give its bytes in "(+ N B first saved by an earlier segment)". For each
tensor: the op that produced it (its grad_fn, `param`, `leaf`), the backward node(s) that save it
(found by walking the graph from the loss and reading each node's `_saved_*` fields), the
innermost module running when it was saved, shape, dtype and bytes. Parameters saved as they are
(fp32 weights read by a Linear) are resident memory, listed but not in the totals.
"""

import argparse
import os
import sys
from collections import OrderedDict

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import family_peer as fp  # noqa: E402


def segments_of(model):
    """Names of the segments: top-level children, and the elements of top-level ModuleLists."""
    out = set()
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            out.update(f"{name}.{i}" for i in range(len(child)))
        else:
            out.add(name)
    return out


def saving_nodes(root):
    """storage data_ptr → names of the backward nodes that hold it as a saved variable."""
    out = {}
    seen = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                v = getattr(node, attr)
            except Exception:  # noqa: BLE001 (freed or not a tensor field)
                continue
            vals = v if isinstance(v, (list, tuple)) else [v]
            for t in vals:
                if torch.is_tensor(t):
                    key = t.untyped_storage().data_ptr()
                    names = out.setdefault(key, [])
                    label = f"{node.name()}.{attr[len('_saved_'):]}"
                    if label not in names:
                        names.append(label)
        for nxt, _ in getattr(node, "next_functions", ()):
            stack.append(nxt)
    return out


def record(fs, seed=0):
    torch.manual_seed(seed)
    device = torch.device("cpu")
    fs.recompute = "none"
    model = fp.prepare_model(fs, device)
    inputs = fp.Inputs(fs, model, device, seed)
    segs = segments_of(model)
    names = {m: n for n, m in model.named_modules()}
    stack = []
    hooks = []

    def pre(mod, _args):
        stack.append(names[mod] or "model")

    def post(mod, _args, _out):
        stack.pop()

    for m in model.modules():
        hooks.append(m.register_forward_pre_hook(pre))
        hooks.append(m.register_forward_hook(post))

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = OrderedDict()
    order = []

    def segment_now():
        if not stack:
            return "step"
        for n in reversed(stack):
            if n in segs:
                return n
        return "model body"

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in saved:
            seg = segment_now()
            if seg not in saved[key]["also"] and seg != saved[key]["segment"]:
                saved[key]["also"].append(seg)
        else:
            if t.grad_fn is not None:
                prod = t.grad_fn.name()
            elif key in params:
                prod = "param"
            else:
                prod = "leaf" if not t.requires_grad else "leaf (grad)"
            seg = segment_now()
            if seg not in order:
                order.append(seg)
            saved[key] = {
                "segment": seg,
                "module": stack[-1] if stack else "-",
                "producer": prod,
                "shape": tuple(t.shape),
                "dtype": str(t.dtype).replace("torch.", ""),
                "bytes": st.nbytes(),
                "param": key in params,
                "also": [],
            }
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pred, target = inputs.forward(model)
        loss = fp.loss_of(fs, pred, target)
    by = saving_nodes(loss.grad_fn)
    for h in hooks:
        h.remove()
    for key, row in saved.items():
        row["saved_by"] = by.get(key, ["?"])
    return model, saved, order


def kind(seg):
    head = seg.split(".")[0]
    return f"{head}.*" if seg != head else seg


def report(fs, saved, order, all_tensors):
    b = fs.microbatch
    d = None
    cfg = fs.cfg
    heads = cfg.get("num_attention_heads")
    hd = cfg.get("attention_head_dim")
    if heads and hd:
        d = heads * hd
    s = fs.image_tokens
    lines = []
    e = b * s * (d or 1)
    lines.append(
        f"### {fs.family} {fs.cls}  precision {fs.precision}  batch {b}  latent {list(fs.latent)}  "
        f"image tokens {s}  text tokens {fs.text_tokens}  hidden {d}  E = b·s·D = {e}"
    )
    per_seg = OrderedDict((seg, []) for seg in order)
    reused = OrderedDict((seg, []) for seg in order)
    for row in saved.values():
        per_seg[row["segment"]].append(row)
        for seg in row["also"]:
            reused.setdefault(seg, []).append(row)
    shown_kinds = set()
    grand = 0
    for seg, rows in per_seg.items():
        act = [r for r in rows if not r["param"]]
        tot = sum(r["bytes"] for r in act)
        grand += tot
        prm = sum(r["bytes"] for r in rows if r["param"])
        k = kind(seg)
        again = sum(r["bytes"] for r in reused.get(seg, []) if not r["param"])
        lines.append(
            f"- {seg:32s} saved {tot:>10d} B  ({tot / e:7.3f} E-bytes, {len(act)} tensors)"
            + (f"  + params saved as-is {prm} B" if prm else "")
            + (f"  (+ {again} B first saved by an earlier segment)" if again else "")
        )
        if k in shown_kinds and not all_tensors:
            continue
        shown_kinds.add(k)
        for r in sorted(rows, key=lambda r: -r["bytes"]) + [dict(r, shared=True) for r in reused.get(seg, [])]:
            lines.append(
                ("  (earlier) " if r.get("shared") else "    ") +
                f"    {r['bytes']:>9d}  {r['dtype']:8s} {str(list(r['shape'])):22s} {r['producer']:28s} "
                f"saved by {', '.join(r['saved_by'])[:70]:70s} in {r['module']}" + ("  [param]" if r["param"] else "")
            )
    lines.append(f"- total saved (activations, excluding parameters saved as-is): {grand} B = {grand / e:.3f} E-bytes")
    # Sides: the segments before the first block (input side) and after the last (output side).
    segs = list(per_seg)
    blocks = [i for i, seg in enumerate(segs) if "." in seg]
    if blocks:
        def total(names):
            return sum(r["bytes"] for n in names for r in per_seg[n] if not r["param"])

        inp, out = segs[: blocks[0]], segs[blocks[-1] + 1 :]
        mid = [n for n in segs[blocks[0] : blocks[-1] + 1] if "." not in n]
        by_kind = OrderedDict()
        for i in blocks:
            by_kind.setdefault(kind(segs[i]), []).append(total([segs[i]]))
        kinds = "; ".join(f"{k} ×{len(v)}: {' / '.join(str(x) for x in v)} B" for k, v in by_kind.items())
        lines.append(f"- sides: input {total(inp)} B ({', '.join(inp)}); blocks {kinds}"
                     + (f"; between blocks {total(mid)} B ({', '.join(mid)})" if mid else "")
                     + f"; output {total(out)} B ({', '.join(out)})")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--precision", default="fp32,bf16-mixed", help="comma-separated (overrides the spec's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--all-tensors", action="store_true", help="list the tensors of every block, not only the first of each kind")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = []
    for prec in args.precision.split(","):
        fs = fp.load_spec(args.spec)
        fs.precision = prec
        _model, saved, order = record(fs)
        out.extend(report(fs, saved, order, args.all_tensors))
        out.append("")
    print("\n".join(out))


if __name__ == "__main__":
    main()
