#!/usr/bin/env python3
"""Where autograd adds a second gradient into a tensor's buffer out of place (issue 49).

    bench/torch_peer/.venv/bin/python bench/torch_peer/runs/2026-12-06-epyc-lora-ff/accumulate_probe.py

A frozen Linear (the PEFT base) and a LoRA pair read the same input x; x's two gradients meet in
autograd's InputBuffer (`torch/csrc/autograd/input_buffer.cpp` `accumulate`). With a 3-D x each
Linear folds it to 2-D, so each gradient is a reshape view of a 2-D `mm` result: the sum is
`old_var + var` (a new tensor, `aten::add` allocates). With a 2-D x the gradients are plain
tensors: `old_var.add_(var)`, nothing allocated. Prints the profiler's add events with the bytes
they allocate.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(2)
base = torch.nn.Linear(256, 64)
base.requires_grad_(False)
lora_a = torch.nn.Linear(256, 8, bias=False)
lora_b = torch.nn.Linear(8, 64, bias=False)


def adds(shape):
    x0 = torch.randn(*shape, requires_grad=True)
    x = x0 * 1.0  # a non-leaf: its gradient is accumulated in its consumer's InputBuffer
    y = base(x) + lora_b(lora_a(x))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        y.sum().backward()
    return [(e.name, e.cpu_memory_usage) for e in p.events() if e.name in ("aten::add", "aten::add_")]


print(f"torch {torch.__version__}, 2 threads")
print(f"x of shape (4, 64, 256) fp32 (262,144 B): {adds((4, 64, 256))}")
print(f"x of shape (256, 256) fp32 (262,144 B): {adds((256, 256))}")
