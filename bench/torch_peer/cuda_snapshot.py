"""`--snapshot FILE` of the peers: the CUDA caching allocator's history over the recorded steps,
written by `torch.cuda.memory._dump_snapshot` for `ditmem compare --snapshot FILE`.

Recording starts after the model (and its EMA copy) is on the device and before the first
warm-up step, so the model's blocks appear in the snapshot's `segments` and the trace holds the
steps; run the peer with `--warmup 1 --steps 0` to record exactly the warm-up step and the
measured step that `ditmem`'s pytorch:cuda prediction lays out. On the CPU there is no caching
allocator to record: the peers exit with status 2 and say so.
"""

import torch

from spec import SpecUnsupported

# Ring buffer of the trace (`max_entries`): a DiT-XL/2 step makes some 20,000 allocation events;
# each entry with its Python stack takes a few KB in the file.
DEFAULT_MAX_ENTRIES = 200_000


def add_arguments(ap):
    """The peers' `--snapshot FILE` and `--snapshot-max-entries N`."""
    ap.add_argument("--snapshot", metavar="FILE", help="CUDA only (runtime pytorch:cuda): record the allocator's "
                    "history from the first warm-up step on and write torch.cuda.memory._dump_snapshot(FILE) "
                    "after the measured step (use --warmup 1 --steps 0; read it with `ditmem compare --snapshot FILE`)")
    ap.add_argument("--snapshot-max-entries", type=int, default=DEFAULT_MAX_ENTRIES,
                    help="ring buffer of the recorded trace (max_entries)")


def check(path, device: torch.device):
    if path and device.type != "cuda":
        raise SpecUnsupported(
            "--snapshot records the CUDA caching allocator (torch.cuda.memory._record_memory_history) "
            "and this run is on the CPU: run the spec with runtime pytorch:cuda (or --device cuda) on a GPU"
        )


def start(path, max_entries: int):
    if path:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")


def dump(path, device: torch.device):
    if path:
        torch.cuda.synchronize(device)
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
