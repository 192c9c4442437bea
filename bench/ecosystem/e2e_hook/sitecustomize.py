"""Memory probe for the end-to-end runs (`end_to_end.py`): put this folder on PYTHONPATH.

Active only in the process whose script is named by DITMEM_E2E_SCRIPT (the training script that
`accelerate launch` starts; the launcher process itself is left alone). It changes nothing the
script computes:

- torch's profiler runs from interpreter start to exit with `profile_memory=True`: every
  allocation and free of PyTorch's CPU allocator is a `[memory]` event with a signed byte count,
  so their running sum is the bytes of live CPU tensors at every moment (what torch allocated
  before the profiler started — importing torch — is a few KiB, not counted);
- `accelerate.Accelerator.accumulate` (the context every script's training step runs in:
  forward, backward, clipping, `optimizer.step()`, `lr_scheduler.step()`, `zero_grad()`) is wrapped
  in a `ditmem::step` record_function range, so each step's window is known;
- the frozen encoders' runs (`AutoencoderKL.encode`, `AutoencoderDC.encode`, the text
  encoders' `forward`) are `ditmem::encode` ranges, so a step's peak splits into the encode's
  and the rest's (the transformer's forward, backward and optimizer step);
- at the start of each step the live tensors are sorted by owner (gc): each model's parameters
  and buffers (LoRA adapters apart), their gradients, the optimizer's state, the rest.

At exit it writes DITMEM_E2E_OUT (JSON): per step the live bytes at its start, the peak inside it,
and the owners at its start; the whole run's peak.
"""

import os
import sys

_SCRIPT = os.environ.get("DITMEM_E2E_SCRIPT")
_argv = getattr(sys, "orig_argv", sys.argv)
if _SCRIPT and any(os.path.basename(a) == _SCRIPT for a in _argv[1:3]):
    import atexit
    import contextlib
    import gc
    import json

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    _prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    _prof.__enter__()
    _owners = []

    def _storages(tensors):
        out = {}
        for t in tensors:
            if t is None or not torch.is_tensor(t) or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            if st.nbytes():
                out[st.data_ptr()] = st.nbytes()
        return out

    def _census():
        """Live CPU tensors by owner, each storage counted once (first owner wins)."""
        seen = {}
        rows = []

        def add(name, tensors, dtypes=None):
            st = {k: v for k, v in _storages(tensors).items() if k not in seen}
            seen.update(st)
            rows.append({"owner": name, "bytes": sum(st.values()), "dtypes": dtypes or []})

        models, optims = [], []
        for o in gc.get_objects():
            try:
                if isinstance(o, torch.nn.Module) and type(o).__module__.startswith(
                    ("diffusers.models", "transformers.models")
                ) and type(o).__name__.endswith(
                    ("Transformer2DModel", "TextModel", "TextModelWithProjection", "EncoderModel",
                     "Gemma2Model", "AutoencoderKL", "AutoencoderDC")
                ):
                    models.append(o)
                elif isinstance(o, torch.optim.Optimizer) and type(o).__module__.startswith("torch.optim"):
                    optims.append(o)
            except ReferenceError:
                continue
        for m in models:
            name = type(m).__name__
            lora = [p for n, p in m.named_parameters() if "lora_" in n]
            base = [p for n, p in m.named_parameters() if "lora_" not in n]
            if lora:
                add(f"{name} LoRA params", lora, sorted({str(p.dtype) for p in lora}))
                add(f"{name} LoRA grads", [p.grad for p in lora])
            add(f"{name} params+buffers", base + list(m.buffers()),
                sorted({str(p.dtype) for p in base}))
            add(f"{name} base grads", [p.grad for p in base])
        for o in optims:
            state = [v for s in o.state.values() for v in s.values()]
            add(f"{type(o).__name__} state", state, sorted({str(v.dtype) for v in state if torch.is_tensor(v)}))
        # What the scripts keep outside the models: the dataset's preprocessed images (host
        # memory on CUDA too: DreamBoothDataset's pixel_values) and the --cache_latents list
        # (on the accelerator's device: DiagonalGaussianDistribution's parameters, std and var,
        # or Sana's latents).
        data, cache = [], []
        for o in gc.get_objects():
            n = type(o).__name__
            if n == "DreamBoothDataset":
                data.extend(getattr(o, "pixel_values", []) or [])
            elif n == "DiagonalGaussianDistribution":
                cache.extend(v for v in vars(o).values() if torch.is_tensor(v))
        # accelerate's DataLoaderShard.__iter__ fetches the next batch before it yields the
        # current one (accelerate/data_loader.py): the next batch is still on the host on CUDA
        # (send_to_device runs when it becomes current).
        for o in gc.get_objects():
            if type(o).__name__ == "generator" and o.gi_frame is not None \
                    and o.gi_code.co_name == "__iter__" and "accelerate" in o.gi_code.co_filename:
                loc = o.gi_frame.f_locals
                nb = loc.get("next_batch")
                # (on the last batch next_batch is the current one)
                if isinstance(nb, dict) and nb is not loc.get("current_batch"):
                    data.extend(v for v in nb.values() if torch.is_tensor(v))
        add("host: DreamBoothDataset pixel_values, prefetched next batch", data)
        add("latent_dist cache (--cache_latents)", cache)
        seen_before_other = set(seen)
        everything = [o for o in gc.get_objects() if torch.is_tensor(o)]
        add("other tensors (gc-visible)", everything)
        # The largest of those, to say what they are.
        big = {}
        for t in everything:
            if t.device.type == "cpu" and t.untyped_storage().data_ptr() not in seen_before_other:
                big[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), str(tuple(t.shape)), str(t.dtype))
        rows[-1]["largest"] = sorted(big.values(), reverse=True)[:8]
        return rows

    def _wrap():
        from accelerate import Accelerator

        orig = Accelerator.accumulate

        @contextlib.contextmanager
        def accumulate(self, *models):
            _owners.append(_census())
            with record_function("ditmem::step"):
                with orig(self, *models) as x:
                    yield x

        Accelerator.accumulate = accumulate

        # The frozen encoders' runs inside a step, as `ditmem::encode` ranges: the VAE's encode
        # and the text encoders' forward.
        import diffusers
        import transformers

        def ranged(cls, name):
            f = getattr(cls, name)

            def g(*a, **k):
                with record_function("ditmem::encode"):
                    return f(*a, **k)

            setattr(cls, name, g)

        for cls in (diffusers.AutoencoderKL, diffusers.AutoencoderDC):
            ranged(cls, "encode")
        for n in ("CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel", "Gemma2Model"):
            ranged(getattr(transformers, n), "forward")

    _wrap()

    def _finish():
        _prof.__exit__(None, None, None)
        kin = _prof.profiler.kineto_results.events()
        events = sorted((e.start_ns(), e.nbytes()) for e in kin if e.name() == "[memory]")
        steps = sorted((e.start_ns(), e.end_ns()) for e in kin if e.name() == "ditmem::step")
        encodes = sorted((e.start_ns(), e.end_ns()) for e in kin if e.name() == "ditmem::encode")
        live = peak = 0
        rows = [{"start": None, "peak": 0, "end": None, "peak_encode": 0, "peak_outside_encode": 0}
                for _ in steps]
        for ts, n in events:
            for k, (a, b) in enumerate(steps):
                if rows[k]["start"] is None and ts >= a:
                    rows[k]["start"] = live
            live += n
            peak = max(peak, live)
            for k, (a, b) in enumerate(steps):
                if a <= ts <= b:
                    rows[k]["peak"] = max(rows[k]["peak"], live)
                    rows[k]["end"] = live
                    enc = any(c <= ts <= d for c, d in encodes)
                    key = "peak_encode" if enc else "peak_outside_encode"
                    rows[k][key] = max(rows[k][key], live)
        for k, r in enumerate(rows):
            r["owners_at_start"] = _owners[k] if k < len(_owners) else []
        out = {
            "what": "bytes of live tensors of PyTorch's CPU allocator (profiler [memory] events, running sum from interpreter start)",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "run_peak": peak,
            "steps": rows,
        }
        with open(os.environ["DITMEM_E2E_OUT"], "w") as f:
            json.dump(out, f, indent=1)

    atexit.register(_finish)
