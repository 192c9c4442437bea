"""The same tiny snapshot dict pickled with protocols 0–5 (hand-built, not from a GPU): a shared
frames list (as `ivalue_symbolize` shares one per traceback), a large address, a non-ASCII
filename. Run: python3 make.py (writes p0.pickle … p5.pickle beside this file)."""
import os
import pickle

here = os.path.dirname(os.path.abspath(__file__))
frames = [{"filename": "train_ä.py", "line": 7, "name": "forward"}]
a = 0x7F12_3456_0000
snap = {
    "segments": [{
        "device": 0, "address": a, "total_size": 2 << 20, "allocated_size": 1024, "active_size": 1024,
        "requested_size": 1000, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
        "is_expandable": False, "frames": frames,
        "blocks": [
            {"address": a, "size": 1024, "requested_size": 1000, "state": "active_allocated", "frames": frames},
            {"address": a + 1024, "size": (2 << 20) - 1024, "requested_size": 0, "state": "inactive", "frames": []},
        ],
    }],
    "device_traces": [[
        {"action": "segment_alloc", "addr": a, "size": 2 << 20, "stream": 0, "time_us": 1, "frames": frames},
        {"action": "alloc", "addr": a, "size": 1000, "stream": 0, "time_us": 2, "frames": frames},
        {"action": "alloc", "addr": a + 1024, "size": 5000, "stream": 0, "time_us": 3, "frames": frames},
        {"action": "free_requested", "addr": a + 1024, "size": 5000, "stream": 0, "time_us": 4, "frames": frames},
        {"action": "free_completed", "addr": a + 1024, "size": 5000, "stream": 0, "time_us": 5, "frames": frames},
    ]],
    "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False, "max_split_size": -1,
                           "garbage_collection_threshold": 0.0, "roundup_power2_divisions": {"1": 0, "2": 0}},
}
for p in range(6):
    with open(os.path.join(here, f"p{p}.pickle"), "wb") as f:
        pickle.dump(snap, f, protocol=p)
