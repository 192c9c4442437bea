#!/usr/bin/env python3
"""oneDNN's bf16 matmul scratchpad on the CPU, as the profiler sees it: for each (m, k, n),
`F.linear` of an (m × k) bf16 input with an (n × k) weight and a bias, once to warm up, then once
under `torch.profiler(profile_memory=True)`; prints the positive `[memory]` events in order (the
output, then the scratchpad that `aten::addmm` allocates and frees inside the call).

    bench/torch_peer/.venv/bin/python bench/torch_peer/gemm_scratch_probe.py [--threads 2]

Compared with `crates/budget/src/runtime/pytorch/ops/cpu_scratch.rs` `cpu_gemm_scratch` (its unit test
`cpu_gemm_scratch_follows_onednn_blocking` holds these figures; `runs/2026-12-06-epyc-lora-ckpt/README.md`).
"""

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

SHAPES = [(616, 256, 64), (256, 256, 64), (128, 256, 64), (64, 256, 64), (300, 256, 64),
          (400, 256, 64), (513, 256, 64), (600, 256, 64), (700, 256, 64), (1024, 256, 64),
          (1100, 64, 64), (2000, 64, 64), (616, 64, 128), (300, 64, 128), (600, 64, 256),
          (616, 64, 256), (256, 64, 256), (256, 768, 64), (256, 1024, 64), (256, 2048, 64),
          (256, 96, 64), (256, 100, 64), (256, 64, 32), (256, 64, 96), (256, 64, 100), (16, 64, 64),
          (8, 64, 64), (40, 64, 64), (33, 64, 64), (616, 64, 4), (616, 4, 64), (256, 4, 256)]
# Weight gradients `grad.t().mm(x)` of a linear with input (m × k) and output (m × n): the
# (n × m) · (m × k) product with its left operand transposed, as (m, k, n).
WEIGHT_GRADS = [(256, 64, 64), (256, 256, 256), (616, 64, 64), (1024, 64, 64), (616, 64, 256),
                (616, 256, 64), (616, 4, 64), (616, 64, 4)]


def allocations(m, k, n):
    a = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16)
    torch.nn.functional.linear(a, w, b)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        torch.nn.functional.linear(a, w, b)
    ev = sorted(p.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    return [e.nbytes() for e in ev if e.name() == "[memory]" and e.nbytes() > 0]


def weight_grad_allocations(m, k, n):
    g = torch.randn(m, n, dtype=torch.bfloat16)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    torch.mm(g.t(), x)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        torch.mm(g.t(), x)
    ev = sorted(p.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    return [e.nbytes() for e in ev if e.name() == "[memory]" and e.nbytes() > 0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for m, k, n in SHAPES:
        print(m, k, n, allocations(m, k, n))
    print("weight gradients grad.t().mm(x), (m, k, n):")
    for m, k, n in WEIGHT_GRADS:
        print(m, k, n, weight_grad_allocations(m, k, n))


if __name__ == "__main__":
    main()
