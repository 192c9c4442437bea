#!/usr/bin/env python3
"""PyTorch peer of a ditmem spec: builds the same DiT, runs warm-up and measured training steps,
and prints one JSON object with the peak memory, step times and the run's conditions.

    bench/torch_peer/.venv/bin/python bench/torch_peer/peer.py --spec FILE.json --warmup W --steps M

The spec is the JSON that `ditmem spec --json` prints. Exit status 2 with a one-line message on
stderr when the spec asks for something the peer does not run.
"""

import argparse
import os
import platform
import statistics
import sys
import time

# Must be set before torch (and its OpenMP runtime) loads: spinning threads distort timings on
# shared cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import record_function  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuda_snapshot  # noqa: E402
import measure  # noqa: E402
from dit import DiT, param_counts  # noqa: E402
from spec import SpecUnsupported, load, peer_main  # noqa: E402

DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def linear_schedule(steps: int = 1000) -> torch.Tensor:
    """ᾱ_t of DiT's linear β schedule (1e-4 … 0.02 over 1000 steps)."""
    betas = torch.linspace(1e-4, 0.02, steps, dtype=torch.float64)
    return torch.cumprod(1.0 - betas, dim=0)


class Trainer:
    def __init__(self, ps, device: torch.device, seed: int):
        torch.manual_seed(seed)
        self.ps = ps
        self.device = device
        m = ps.model
        self.param_dtype = torch.float64 if ps.precision == "fp64" else torch.float32
        self.autocast = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(ps.precision)
        self.model = DiT(m, ps.latent_h, ps.latent_w, ps.fused_attention, ps.checkpoint_blocks)
        self.model.to(device=device, dtype=self.param_dtype).train()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        # The spec's implementation, else PyTorch's own default (foreach=None, fused=None: the
        # for-loop on the CPU, foreach on CUDA; `torch/optim/optimizer.py` _default_to_fused_or_foreach).
        impl = {"foreach": {"foreach": True}, "for-loop": {"foreach": False}, "fused": {"fused": True}}
        kw = impl.get(ps.optimizer_impl, {})
        if ps.optimizer == "adamw":
            # DiT train.py: AdamW(lr=1e-4, weight_decay=0).
            self.opt = torch.optim.AdamW(self.trainable, lr=1e-4, weight_decay=0.0, **kw)
        else:
            self.opt = torch.optim.SGD(self.trainable, lr=1e-4, **kw)
        self.optimizer_impl = ps.optimizer_impl or ("foreach" if device.type == "cuda" else "for-loop")
        self.ema = []
        if ps.ema:
            dt = DTYPES[ps.ema_dtype]
            self.ema = [p.detach().to(dtype=dt, copy=True) for p in self.trainable]
        self.scaler = None
        if ps.precision == "fp16-mixed":
            self.scaler = torch.amp.GradScaler(device.type)
        self.acp = linear_schedule().to(device=device, dtype=self.param_dtype)
        self.gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        self.losses = []

    def batch(self):
        ps, m = self.ps, self.ps.model
        b = ps.microbatch
        g = self.gen
        x0 = torch.randn(b, m["in_channels"], ps.latent_h, ps.latent_w, generator=g, dtype=self.param_dtype)
        y = torch.randint(0, m["num_classes"], (b,), generator=g)
        t = torch.randint(0, len(self.acp), (b,), generator=g)
        return x0.to(self.device), y.to(self.device), t.to(self.device)

    def microbatch(self):
        t0 = time.perf_counter()
        with record_function("ditmem::forward"):
            loss = self.forward_loss()
        t1 = time.perf_counter()
        with record_function("ditmem::backward"):
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
        self.sync()
        t2 = time.perf_counter()
        self.phase_s["forward"] += t1 - t0
        self.phase_s["backward"] += t2 - t1
        return loss.detach().item()

    def forward_loss(self):
        """Data, noising, forward and loss; only the loss leaves this function (as in DiT's
        `training_losses`), so the model output is released once autograd no longer needs it."""
        ps = self.ps
        x0, y, t = self.batch()
        noise = torch.randn_like(x0)
        ab = self.acp[t].view(-1, 1, 1, 1)
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        target = noise if ps.prediction == "eps" else ab.sqrt() * noise - (1 - ab).sqrt() * x0
        if self.autocast is not None:
            with torch.autocast(self.device.type, dtype=self.autocast):
                out = self.model(xt, t, y)
        else:
            out = self.model(xt, t, y)
        pred = out[:, : ps.model["in_channels"]]
        return F.mse_loss(pred.to(self.param_dtype), target) / ps.accumulation

    def step(self):
        # Wall seconds of this step's phases (the engine's `phase_time_s`): the forward with the
        # data and the loss, the backward (recomputed forwards included), the optimizer. On CUDA
        # the forward's kernels may still run when the backward's clock starts.
        self.phase_s = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        total = 0.0
        for _ in range(self.ps.accumulation):
            total += self.microbatch()
        self.losses.append(total)
        t0 = time.perf_counter()
        with record_function("ditmem::optimizer"):
            self.optimizer_step()
        self.sync()
        self.phase_s["optimizer"] += time.perf_counter() - t0

    def optimizer_step(self):
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        if self.ema:
            with torch.no_grad():
                d = self.ps.ema_decay
                src = [p.detach().to(e.dtype) for p, e in zip(self.trainable, self.ema)]
                torch._foreach_mul_(self.ema, d)
                torch._foreach_add_(self.ema, src, alpha=1 - d)
        self.opt.zero_grad(set_to_none=True)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def percentiles(times):
    s = sorted(times)

    def pct(q):
        if not s:
            return None
        k = (len(s) - 1) * q
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {
        "p50": pct(0.50),
        "p95": pct(0.95),
        "p99": pct(0.99),
        "mean": statistics.fmean(s) if s else None,
        "n": len(s),
    }


def set_sdpa_backend(backend: str):
    """Restrict SDPA to one backend on CUDA (auto leaves PyTorch's choice)."""
    if backend == "auto":
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }
    if backend not in names:
        raise SpecUnsupported(f"sdpa backend '{backend}'; allowed: {', '.join(names)}")
    return sdpa_kernel([names[backend]])


def run(args) -> dict:
    ps = load(args.spec)
    if args.device:
        ps.device = args.device
    if ps.device == "cuda" and not torch.cuda.is_available():
        raise SpecUnsupported("device cuda requested but torch.cuda.is_available() is False")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(ps.device)
    cuda_snapshot.check(args.snapshot, device)
    ctx = set_sdpa_backend(ps.sdpa_backend)
    if ctx is not None:
        ctx.__enter__()
    if device.type == "cuda":
        torch.cuda.init()
        ctx_free, ctx_total = torch.cuda.mem_get_info(device)
    tr = Trainer(ps, device, args.seed)
    counts = param_counts(tr.model)

    cuda_snapshot.start(args.snapshot, args.snapshot_max_entries)
    for _ in range(args.warmup):
        tr.step()
    tr.sync()
    times, cpu, phases = [], [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        tr.step()
        tr.sync()
        times.append(time.perf_counter() - t0)
        phases.append(dict(tr.phase_s))
        # CPU seconds of the process, every thread (the engine's step_cpu_time_s likewise).
        cpu.append(time.process_time() - c0)

    tr.opt.zero_grad(set_to_none=True)
    resident = measure.tensor_bytes(measure.resident_tensors(tr.model, tr.opt, tr.ema))
    result = {
        "resident_bytes": resident,
        "params": counts,
        "step_time_s": percentiles(times),
        "step_cpu_time_s": percentiles(cpu),
        "phase_time_s": {k: percentiles([p[k] for p in phases]) for k in ("forward", "backward", "optimizer")},
        "losses": tr.losses,
    }
    if device.type == "cpu":
        above, net, phases = measure.cpu_step_peak(tr.step)
        result["peak_bytes"] = resident + above
        result["phase_peaks"] = {k: resident + v for k, v in phases.items()}
        result["step_peak_above_resident"] = above
        result["step_net_bytes"] = net
        result["method"] = "torch.profiler profile_memory: max running sum of [memory] events over one step"
    else:
        c = measure.cuda_step_peak(tr.step, device)
        cuda_snapshot.dump(args.snapshot, device)
        if args.snapshot:
            result["snapshot"] = args.snapshot
        result["peak_bytes"] = c["max_allocated"]
        result["peak_reserved_bytes"] = c["max_reserved"]
        result["cuda"] = c
        result["cuda"]["used_before_model"] = ctx_total - ctx_free
        result["method"] = "torch.cuda.max_memory_allocated / max_memory_reserved after reset_peak_memory_stats"
    result["conditions"] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": ps.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        # The ATen kernels' ISA (AVX512, AVX2, ...) and the settings that cap it and oneDNN's.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY", "unset"),
        "onednn_max_cpu_isa_env": os.environ.get("ONEDNN_MAX_CPU_ISA", "unset"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "precision": ps.precision,
        "autocast": str(tr.autocast).replace("torch.", "") if tr.autocast else None,
        "attention": "sdpa" if ps.fused_attention else "math (explicit softmax)",
        "sdpa_backend": ps.sdpa_backend,
        "checkpoint_blocks": ps.checkpoint_blocks,
        "optimizer": f"{ps.optimizer} ({tr.optimizer_impl})",
        "ema": ps.ema,
        "microbatch": ps.microbatch,
        "accumulation": ps.accumulation,
        "tokens": (ps.latent_h // ps.model["patch"]) * (ps.latent_w // ps.model["patch"]),
        "warmup": args.warmup,
        "steps": args.steps,
        "seed": args.seed,
    }
    if ctx is not None:
        ctx.__exit__(None, None, None)
    return result


def count_only(args) -> dict:
    ps = load(args.spec)
    with torch.device("meta"):
        model = DiT(ps.model, ps.latent_h, ps.latent_w, ps.fused_attention, ps.checkpoint_blocks)
    return {"params": param_counts(model)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True, help="spec JSON (ditmem spec --json)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="override the spec runtime's device")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--params-only", action="store_true", help="build the model, print its parameter counts")
    cuda_snapshot.add_arguments(ap)
    args = ap.parse_args(argv)
    return peer_main("peer", args, count_only if args.params_only else run)


if __name__ == "__main__":
    sys.exit(main())
