#!/usr/bin/env python3
"""A SYNTHETIC memory snapshot in the format of `torch.cuda.memory._dump_snapshot`, made on a
machine without a GPU from the peer's own CPU step — for tests of `ditmem compare --snapshot`.
It is not a GPU measurement.

    bench/torch_peer/.venv/bin/python bench/torch_peer/snapshot_from_trace.py --spec S.json \
        --out FILE.pickle [--threads 2] [--seed 0]

What it does:
1. builds the DiT peer's `Trainer` (`peer.py`) for the spec on the CPU (the spec's runtime device
   is ignored; its optimizer implementation is kept, so a `foreach` spec runs `foreach` here);
2. records the warm-up step and the measured step with `torch.profiler(profile_memory=True)`
   and reads every CPU allocation and free of the two steps in time order, with its `ditmem::`
   phase and op chain (`family_trace.allocations`, the event tree of the profiler);
3. replays them on a small model of the CUDA caching allocator written from the documented
   rules (`c10/cuda/CUDACachingAllocator.cpp`): sizes rounded up to 512 B, small (≤ 1 MiB) and
   large pools, 2 MiB segments for small requests, 20 MiB below 10 MiB, the request rounded to
   2 MiB above; best fit by (size, address), splitting (small pool: remainder ≥ 512 B; large:
   remainder > 1 MiB), merging on free; nothing is ever released. The model's weights, buffers and
   EMA copies are allocated first, before "recording" starts, so they appear only in `segments`,
   as they do when `_record_memory_history` is called after `model.to("cuda")`;
4. writes the snapshot dict — `segments` (with `blocks`), `device_traces` (one device: `alloc`,
   `free_requested`, `free_completed`, `segment_alloc` entries with `addr`, `size`, `stream`,
   `time_us`, `frames`) and `allocator_settings` — with `pickle.dump` (protocol 4, as
   `_dump_snapshot` on Python ≤ 3.13).

The frames are synthetic too: the innermost names the innermost op of the profiler's chain under the filename
`<synthetic: torch.profiler CPU trace>`, the outer one a file and function standing for the phase
(`torch/autograd/graph.py:_engine_run_backward` for the backward, `torch/optim/adamw.py:_init_group`
for optimizer allocations that outlive the step, i.e. its state, other optimizer allocations
`torch/optim/adamw.py:step`, the forward `bench/torch_peer/peer.py:forward_loss`). CPU kernels
differ from CUDA ones (SDPA, matmul workspaces), so the trace is the CPU step's, in CUDA's layout.
"""

import argparse
import os
import pickle
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import family_trace  # noqa: E402
from peer import Trainer  # noqa: E402
from spec import load  # noqa: E402

MIB = 1 << 20
BASE = 0x7F00_0000_0000  # first segment address (made up, 2 MiB aligned)


def round_size(n):
    """`round_size` without roundup_power2_divisions: at least 512 B, a multiple of 512 B."""
    return 512 if n < 512 else (n + 511) // 512 * 512


def allocation_size(n):
    """`get_allocation_size`."""
    if n <= MIB:
        return 2 * MIB
    if n < 10 * MIB:
        return 20 * MIB
    return (n + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)


class Allocator:
    """The documented rules of the native caching allocator, one stream, no capacity limit."""

    def __init__(self):
        self.segments = []  # dicts: address, size, small, blocks: [address, size, requested, alive]
        self.next_addr = BASE
        self.trace = None  # list of entries while recording
        self.t_us = 0

    def record(self, action, addr, size, frames):
        if self.trace is not None:
            self.t_us += 1
            self.trace.append(
                {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": self.t_us, "frames": frames}
            )

    def malloc(self, requested, frames):
        size = round_size(requested)
        small = size <= MIB
        best = None
        for seg in self.segments:
            if seg["small"] != small:
                continue
            for i, b in enumerate(seg["blocks"]):
                if not b[3] and b[1] >= size and (best is None or (b[1], b[0]) < (best[2][1], best[2][0])):
                    best = (seg, i, b)
        if best is None:
            total = allocation_size(size)
            seg = {"address": self.next_addr, "size": total, "small": small, "blocks": [[self.next_addr, total, 0, False, []]]}
            self.next_addr += (total + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)
            self.segments.append(seg)
            self.record("segment_alloc", seg["address"], total, frames)
            best = (seg, 0, seg["blocks"][0])
        seg, i, b = best
        rest = b[1] - size
        split = rest >= 512 if small else rest > MIB
        if split:
            seg["blocks"].insert(i + 1, [b[0] + size, rest, 0, False, []])
            b[1] = size
        b[2] = requested
        b[3] = True
        b[4] = frames
        self.record("alloc", b[0], requested, frames)
        return b[0]

    def free(self, addr):
        """`free` then `free_block`: both entries carry the block's requested size and, with no
        context of their own, the allocation's frames."""
        for seg in self.segments:
            for i, b in enumerate(seg["blocks"]):
                if b[0] == addr and b[3]:
                    requested, frames = b[2], b[4]
                    self.record("free_requested", addr, requested, frames)
                    b[3] = False
                    b[2] = 0
                    blocks = seg["blocks"]
                    if i + 1 < len(blocks) and not blocks[i + 1][3]:
                        b[1] += blocks.pop(i + 1)[1]
                    if i > 0 and not blocks[i - 1][3]:
                        blocks[i - 1][1] += blocks.pop(i)[1]
                    self.record("free_completed", addr, requested, frames)
                    return True
        return False

    def state(self):
        out = []
        for seg in self.segments:
            blocks = [
                {"address": a, "size": s, "requested_size": r if alive else 0,
                 "state": "active_allocated" if alive else "inactive", "frames": []}
                for a, s, r, alive, _f in seg["blocks"]
            ]
            alloc = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            out.append({
                "device": 0, "address": seg["address"], "total_size": seg["size"],
                "allocated_size": alloc, "active_size": alloc,
                "requested_size": sum(b["requested_size"] for b in blocks),
                "stream": 0, "segment_type": "small" if seg["small"] else "large",
                "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks,
            })
        return out


def phase_frames(phase, chain, outlives):
    """Synthetic frames: the op chain, then a file/function standing for the phase."""
    if phase == "backward":
        outer = ("torch/autograd/graph.py", "_engine_run_backward")
    elif phase == "optimizer":
        outer = ("torch/optim/adamw.py", "_init_group") if outlives else ("torch/optim/adamw.py", "step")
    else:
        outer = ("bench/torch_peer/peer.py", "forward_loss")
    return [
        {"filename": "<synthetic: torch.profiler CPU trace>", "line": 0, "name": chain.split(" > ")[-1]},
        {"filename": outer[0], "line": 0, "name": outer[1]},
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ps = load(args.spec)
    ps.device = "cpu"
    tr = Trainer(ps, torch.device("cpu"), args.seed)
    a = Allocator()
    # The model on the device before recording: parameters, buffers, EMA, the noise schedule.
    seen = set()
    for t in list(tr.model.parameters()) + list(tr.model.buffers()) + list(tr.ema) + [tr.acp]:
        st = t.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            continue
        seen.add(st.data_ptr())
        a.malloc(st.nbytes(), [])
    # Warm-up and measured step, recorded.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tr.step()
        tr.step()
    events = family_trace.allocations(prof)
    # Which pointers outlive the recording (the optimizer state made by the first step).
    alive = {}
    for i, (_t, n, ptr, _ph, _ch) in enumerate(events):
        if n > 0:
            alive[ptr] = i
        else:
            alive.pop(ptr, None)
    outlives = set(alive.values())
    a.trace = []
    where = {}
    frame_cache = {}
    for i, (_t, n, ptr, ph, ch) in enumerate(events):
        if n > 0:
            key = (ph, ch, i in outlives)
            frames = frame_cache.get(key)
            if frames is None:
                frames = frame_cache[key] = phase_frames(ph, ch, i in outlives)
            where[ptr] = a.malloc(n, frames)
        elif ptr in where:
            a.free(where.pop(ptr))
        # A free of a CPU block made before the window (none for a step that starts clean) is
        # not on the device: skipped.
    snapshot = {
        "segments": a.state(),
        "device_traces": [a.trace],
        "allocator_settings": {
            "PYTORCH_CUDA_ALLOC_CONF": "",
            "max_split_size": -1,
            "garbage_collection_threshold": 0.0,
            "expandable_segments": False,
            "pinned_num_register_threads": 1,
            "release_lock_on_cudamalloc": False,
            "pinned_use_cuda_host_register": False,
            "roundup_power2_divisions": {str(1 << k): 0 for k in range(16)},
        },
        "synthetic": "made by bench/torch_peer/snapshot_from_trace.py from the peer's CPU step; not a GPU measurement",
    }
    with open(args.out, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)
    print(f"{args.out}: {len(a.trace)} trace entries, {len(a.segments)} segments, "
          f"{os.path.getsize(args.out)} bytes (synthetic)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
