"""Counts the transformer's 16-bit weight copies in the replica (put this folder on PYTHONPATH;
active only in train_dreambooth_sd3.py's process; changes nothing it computes).

- Every tensor the transformer's forward saves for the backward passes through a
  `torch.autograd.graph.saved_tensors_hooks` pack hook (the class's forward is wrapped before
  accelerate wraps it in autocast). A saved tensor is an autocast cast of a parameter when its
  autograd history, through views (a linear saves its weight transposed), reaches a
  `ToCopyBackward0` whose input is that parameter's `AccumulateGrad`: counted once per storage,
  with the parameter it copies.
- At the entry of `Accelerator.backward` (the step's worst moment starts there) every
  gc-visible bf16/fp16 tensor whose storage is the size of a transformer parameter in 16 bits is
  sorted: a module's `Parameter` (the text encoders' weights in the weight dtype), a storage the
  forward saved (casts and activations that happen to be that size), or neither — a 16-bit copy
  of a weight held anywhere else in Python (a module attribute, a list, a pipeline) would be
  "neither".

Writes DITMEM_CASTS_OUT (JSON): per training forward the casts saved (count, distinct
parameters, bytes) beside the transformer's parameter count and 16-bit bytes; per backward the
three counts.
"""
import os
import sys

_argv = getattr(sys, "orig_argv", sys.argv)
if any(os.path.basename(a) == "train_dreambooth_sd3.py" for a in _argv[1:3]):
    import atexit
    import gc
    import json

    import torch

    _rows = {"forwards": [], "backwards": []}
    _last = {"saved": set(), "sizes": set()}
    _low = (torch.bfloat16, torch.float16)
    _views = {"TBackward0", "TransposeBackward0", "ViewBackward0", "UnsafeViewBackward0",
              "PermuteBackward0", "ExpandBackward0", "ReshapeAliasBackward0", "AsStridedBackward0"}

    def _cast_of(t, params):
        f = t.grad_fn
        while f is not None and type(f).__name__ in _views:
            f = f.next_functions[0][0]
        if f is None or type(f).__name__ != "ToCopyBackward0":
            return None
        acc = f.next_functions[0][0]
        v = getattr(acc, "variable", None)
        return params.get(id(v)) if v is not None else None

    def _install():
        import diffusers
        from accelerate import Accelerator

        cls = diffusers.SD3Transformer2DModel
        orig = cls.forward

        def forward(self, *a, **k):
            if not torch.is_grad_enabled():
                return orig(self, *a, **k)
            params = {id(p): n for n, p in self.named_parameters()}
            casts, saved = {}, set()

            def pack(t):
                st = t.untyped_storage()
                saved.add(st.data_ptr())
                if t.dtype in _low:
                    n = _cast_of(t, params)
                    if n is not None:
                        casts[st.data_ptr()] = (n, st.nbytes())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = orig(self, *a, **k)
            _last["saved"] = saved
            _last["sizes"] = {p.numel() * 2 for p in self.parameters()}
            _rows["forwards"].append({
                "saved_casts": len(casts), "distinct_parameters": len({n for n, _ in casts.values()}),
                "bytes": sum(b for _, b in casts.values()),
                "parameters": len(params), "parameter_bytes_16bit": sum(p.numel() * 2 for p in self.parameters()),
            })
            return out

        cls.forward = forward
        ob = Accelerator.backward

        def backward(self, loss, **kw):
            par, sav, other, shapes = {}, {}, {}, set()
            for o in gc.get_objects():
                if not (torch.is_tensor(o) and o.dtype in _low):
                    continue
                st = o.untyped_storage()
                if st.nbytes() not in _last["sizes"]:
                    continue
                d = par if isinstance(o, torch.nn.Parameter) else sav if st.data_ptr() in _last["saved"] else other
                d[st.data_ptr()] = st.nbytes()
                if d is other:
                    shapes.add(f"{tuple(o.shape)} {str(o.dtype)[6:]}")
            _rows["backwards"].append({"parameters_16bit": len(par), "saved_by_the_forward": len(sav),
                                       "other": len(other), "other_bytes": sum(other.values()),
                                       "other_shapes": sorted(shapes)})
            return ob(self, loss, **kw)

        Accelerator.backward = backward

    _install()

    def _finish():
        with open(os.environ["DITMEM_CASTS_OUT"], "w") as f:
            json.dump(_rows, f, indent=1)

    atexit.register(_finish)
