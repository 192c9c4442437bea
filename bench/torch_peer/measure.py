"""Peak-memory measurement of one training step.

CPU: PyTorch exposes no allocator statistics, so the step is recorded once with
`torch.profiler.profile(activities=[CPU], profile_memory=True)`; every tensor allocation and free
of the CPU allocator is a `[memory]` event with a signed byte count. The maximum of their running
sum, in time order, is the step's peak above what was alive when the window opened (parameters,
optimizer state, EMA: grads are None there). Tensor-exact and identical run to run.

CUDA: `torch.cuda.reset_peak_memory_stats()` before the step and `max_memory_allocated` /
`max_memory_reserved` after it (the caching allocator's own counters).
"""

import torch
from torch.profiler import ProfilerActivity, profile


def tensor_bytes(tensors) -> int:
    seen = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in seen or st.nbytes() == 0:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def resident_tensors(model, optimizer, ema_params):
    """Everything alive between steps: parameters, buffers, optimizer state, EMA copy."""
    out = list(model.parameters()) + list(model.buffers())
    for state in optimizer.state.values():
        out.extend(v for v in state.values() if torch.is_tensor(v))
    out.extend(ema_params)
    return out


def cpu_step_peak(step_fn) -> tuple:
    """Run `step_fn` once under the memory profiler; returns (peak above start, net change,
    peak above start per phase). Phases are the `ditmem::*` record_function ranges."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step_fn()
    kin = prof.profiler.kineto_results.events()
    events = sorted((e.start_ns(), e.nbytes()) for e in kin if e.name() == "[memory]")
    ranges = [
        (e.name().split("::", 1)[1], e.start_ns(), e.end_ns())
        for e in kin
        if e.name().startswith("ditmem::")
    ]
    live = peak = 0
    phases = {}
    for ts, n in events:
        live += n
        peak = max(peak, live)
        for name, a, b in ranges:
            if a <= ts <= b:
                phases[name] = max(phases.get(name, 0), live)
    return peak, live, phases


def cuda_step_peak(step_fn, device) -> dict:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step_fn()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {
        "allocated_before": before,
        "max_allocated": torch.cuda.max_memory_allocated(device),
        "max_reserved": torch.cuda.max_memory_reserved(device),
        "reserved_after": torch.cuda.memory_reserved(device),
        "device_used_after": total - free,
        "device_total": total,
    }
