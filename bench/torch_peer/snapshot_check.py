#!/usr/bin/env python3
"""The counters of a synthetic snapshot written by `snapshot_from_trace.py`, recomputed by its own
allocator model: the blocks alive before the trace are allocated first (in address order, as the
model's tensors were), then every `alloc` / `free_requested` of the trace is replayed, each
returned address checked against the trace's. Prints the allocated bytes before the trace, the
largest allocated (sum of live block sizes, unsplit blocks whole, as `max_memory_allocated`) and
the reserved bytes. These are the expected values of `crates/cli/tests/snapshot_cli.rs`.

    bench/torch_peer/.venv/bin/python bench/torch_peer/snapshot_check.py FILE.pickle [...]

(The allocator model is plain Python, but `snapshot_from_trace` imports torch and the peer.)
"""

import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def check(path):
    from snapshot_from_trace import Allocator

    with open(path, "rb") as f:
        s = pickle.load(f)
    tr = s["device_traces"][0]
    touched = {e["addr"] for e in tr if e["action"] in ("alloc", "free_requested", "free_completed")}
    pre = sorted((b["address"], b["size"]) for g in s["segments"] for b in g["blocks"]
                 if b["state"] == "active_allocated" and b["address"] not in touched)
    a = Allocator()
    for addr, size in pre:
        got = a.malloc(size, [])
        assert got == addr, f"{path}: model block at {got:#x}, snapshot at {addr:#x}"

    def live():
        return sum(b[1] for g in a.segments for b in g["blocks"] if b[3])

    before = live()
    reserved_before = sum(g["size"] for g in a.segments)
    top = before
    for e in tr:
        if e["action"] == "alloc":
            got = a.malloc(e["size"], [])
            assert got == e["addr"], f"{path}: alloc at {got:#x}, trace at {e['addr']:#x}"
            top = max(top, live())
        elif e["action"] == "free_requested":
            assert a.free(e["addr"]), f"{path}: free of {e['addr']:#x} not allocated"
    reserved = sum(g["size"] for g in a.segments)
    print(f"{path}: allocated before {before}, max allocated {top}, reserved before {reserved_before}, "
          f"max reserved {reserved} (nothing is released)")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        check(p)
