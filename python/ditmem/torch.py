"""Your own training step measured beside ditmem's prediction. Imports torch only when used.

- :func:`measure` runs ``step_fn`` (one whole training step: forward, backward, optimizer)
  ``warmup`` times, then measures: on CUDA the caching allocator's own counters after
  ``torch.cuda.reset_peak_memory_stats`` (``max_memory_allocated``, ``max_memory_reserved``) and
  the device's use from ``torch.cuda.mem_get_info``; on the CPU (which has no allocator
  statistics) one step recorded by ``torch.profiler.profile(profile_memory=True)``, the peak of
  the running sum of its ``[memory]`` events in time order — the method of
  ``bench/torch_peer/measure.py`` (``cpu_step_peak``) — plus what was alive before the step
  when ``resident=`` names it. Step times: p50 / p95 / p99 over the measured steps.
- :func:`compare` puts a :class:`ditmem.Estimate` (or :class:`ditmem.Plan`) beside a
  :class:`Measurement`: predicted, measured and their ratio.
- :func:`snapshot` records the CUDA caching allocator's history
  (``torch.cuda.memory._record_memory_history``) and dumps the pickle
  (``torch.cuda.memory._dump_snapshot``) that ``ditmem compare --snapshot FILE`` reads.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

from ._format import fmt_bytes, fmt_secs, html_bar, html_escape, html_table

__all__ = ["measure", "compare", "snapshot", "Measurement", "Comparison", "SnapshotUnavailable"]

#: Ring buffer of the snapshot's trace: a DiT-XL/2 step makes some 20,000 allocation events
#: (bench/torch_peer/cuda_snapshot.py's default).
DEFAULT_MAX_ENTRIES = 200_000


class SnapshotUnavailable(RuntimeError):
    """`snapshot` needs CUDA: the CPU has no caching allocator whose history could be recorded."""


def _import_torch():
    """torch, imported when first needed (the tests replace this with a stand-in)."""
    import torch  # noqa: PLC0415

    return torch


# ----------------------------------------------------------------------------------------------
# measure


def _percentile(sorted_values: List[float], q: float) -> Optional[float]:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, int(-(-q * len(sorted_values) // 100)) - 1))
    return sorted_values[k]


def _tensors_of(torch, things: Any) -> Iterator[Any]:
    """Tensors held by `things`: tensors, modules (parameters, buffers, their grads),
    optimizers (their state), or iterables of these."""
    if things is None:
        return
    if torch.is_tensor(things):
        yield things
        if getattr(things, "grad", None) is not None:
            yield things.grad
        return
    if hasattr(things, "parameters") and hasattr(things, "buffers"):
        for p in things.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from things.buffers()
        return
    state = getattr(things, "state", None)
    if state is not None and hasattr(things, "param_groups"):
        for s in state.values():
            for v in s.values():
                if torch.is_tensor(v):
                    yield v
        return
    if isinstance(things, dict):
        things = things.values()
    for t in things:
        yield from _tensors_of(torch, t)


def _storage_bytes(torch, tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind `tensors` (measure.py's `tensor_bytes`)."""
    seen = set()
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in seen or st.nbytes() == 0:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def _cpu_step_peak(torch, step_fn: Callable[[], Any]) -> int:
    """One step under the memory profiler; the peak of the running sum of the CPU allocator's
    `[memory]` events above what was alive when the window opened (measure.py `cpu_step_peak`)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step_fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


class Measurement:
    """What :func:`measure` found. On CUDA: ``max_allocated_bytes``, ``max_reserved_bytes``
    (after ``reset_peak_memory_stats``, over the measured steps), ``device_used_bytes``
    (total − free from ``mem_get_info``: what nvidia-smi shows for all processes),
    ``device_total_bytes``. On the CPU: ``step_peak_bytes`` (the profiled step's peak above its
    start) and ``resident_bytes`` (what ``resident=`` holds). ``peak_bytes`` is the allocated
    peak on either device (CPU: resident + step peak). Times in seconds."""

    def __init__(self, data: Dict[str, Any]):
        self._data = data
        self.device: str = data["device"]
        self.peak_bytes: Optional[int] = data.get("peak_bytes")
        self.max_allocated_bytes: Optional[int] = data.get("max_allocated_bytes")
        self.max_reserved_bytes: Optional[int] = data.get("max_reserved_bytes")
        self.allocated_before_bytes: Optional[int] = data.get("allocated_before_bytes")
        self.device_used_bytes: Optional[int] = data.get("device_used_bytes")
        self.device_total_bytes: Optional[int] = data.get("device_total_bytes")
        self.step_peak_bytes: Optional[int] = data.get("step_peak_bytes")
        self.resident_bytes: Optional[int] = data.get("resident_bytes")
        self.step_times_s: List[float] = list(data.get("step_times_s") or [])
        self.p50_s: Optional[float] = data.get("p50_s")
        self.p95_s: Optional[float] = data.get("p95_s")
        self.p99_s: Optional[float] = data.get("p99_s")
        self.conditions: Dict[str, Any] = dict(data.get("conditions") or {})

    def to_dict(self) -> Dict[str, Any]:
        return copy.deepcopy(self._data)

    def lines(self) -> List[str]:
        out = []
        if self.device.startswith("cuda"):
            out.append(
                f"measured on {self.device}: peak {fmt_bytes(self.max_allocated_bytes)} allocated, "
                f"{fmt_bytes(self.max_reserved_bytes)} reserved; device "
                f"{fmt_bytes(self.device_used_bytes)} of {fmt_bytes(self.device_total_bytes)} used"
            )
        else:
            resident = (
                f" = {fmt_bytes(self.resident_bytes)} resident + {fmt_bytes(self.step_peak_bytes)} in the step"
                if self.resident_bytes is not None
                else " above the step's start (resident= not given)"
            )
            out.append(f"measured on {self.device}: peak {fmt_bytes(self.peak_bytes)}{resident}")
        n = len(self.step_times_s)
        out.append(
            f"step: p50 {fmt_secs(self.p50_s)}, p95 {fmt_secs(self.p95_s)}, "
            f"p99 {fmt_secs(self.p99_s)} over {n} step{'s' if n != 1 else ''} "
            f"after {self.conditions.get('warmup')} warm-up"
        )
        c = self.conditions
        out.append(
            f"conditions: torch {c.get('torch')}, {c.get('device_name')}, dtype {c.get('dtype')}, "
            f"{c.get('threads')} threads, PYTORCH_CUDA_ALLOC_CONF={c.get('alloc_conf') or '(unset)'}"
        )
        return out

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        rows = [[k.replace("_", " "), v] for k, v in self._rows()]
        return (
            html_bar(self.device_used_bytes, self.device_total_bytes, self.device)
            + html_table(rows)
        )

    def _rows(self):
        for k in (
            "peak_bytes",
            "max_allocated_bytes",
            "max_reserved_bytes",
            "device_used_bytes",
            "device_total_bytes",
            "resident_bytes",
            "step_peak_bytes",
        ):
            v = self._data.get(k)
            if v is not None:
                yield k, fmt_bytes(v)
        for k in ("p50_s", "p95_s", "p99_s"):
            yield k, fmt_secs(self._data.get(k))


def _resolve_device(torch, device: Any) -> Any:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    d = torch.device(device) if not hasattr(device, "type") else device
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _dtype_of(torch, resident: Any, dtype: Any) -> Optional[str]:
    if dtype is not None:
        return str(dtype).replace("torch.", "")
    for t in _tensors_of(torch, resident):
        if getattr(t, "is_floating_point", lambda: False)():
            return str(t.dtype).replace("torch.", "")
    return None


def measure(
    step_fn: Callable[[], Any],
    warmup: int = 1,
    steps: int = 3,
    device: Any = None,
    resident: Any = None,
    dtype: Any = None,
) -> Measurement:
    """Run your training step and measure its memory and time.

    ``step_fn`` is one whole step (forward, backward, ``optimizer.step()``,
    ``optimizer.zero_grad()``). It runs ``warmup`` times unmeasured (the optimizer's state and
    the allocator's cache exist after the first step), then:

    - CUDA: ``steps`` steps after ``torch.cuda.reset_peak_memory_stats``; the peak is their
      ``max_memory_allocated`` / ``max_memory_reserved``, the device use ``mem_get_info``'s
      total − free after them;
    - CPU: one step under the memory profiler (its peak above its start; plus what
      ``resident=`` — a module, an optimizer, tensors or a list of these — holds before it),
      then ``steps`` steps timed without the profiler.

    ``device`` defaults to the current CUDA device when there is one, else the CPU; ``dtype``
    (for the record) defaults to the first floating parameter of ``resident``.
    """
    if warmup < 0 or steps < 1:
        raise ValueError(
            f"invalid input: warmup {warmup}, steps {steps}; allowed: warmup >= 0, steps >= 1"
        )
    torch = _import_torch()
    dev = _resolve_device(torch, device)
    is_cuda = dev.type == "cuda"

    def sync():
        if is_cuda:
            torch.cuda.synchronize(dev)

    for _ in range(warmup):
        step_fn()
    sync()

    data: Dict[str, Any] = {"device": str(dev)}
    times: List[float] = []
    if is_cuda:
        torch.cuda.reset_peak_memory_stats(dev)
        data["allocated_before_bytes"] = int(torch.cuda.memory_allocated(dev))
        for _ in range(steps):
            t0 = time.perf_counter()
            step_fn()
            sync()
            times.append(time.perf_counter() - t0)
        free, total = torch.cuda.mem_get_info(dev)
        data["max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(dev))
        data["max_reserved_bytes"] = int(torch.cuda.max_memory_reserved(dev))
        data["device_used_bytes"] = int(total - free)
        data["device_total_bytes"] = int(total)
        data["peak_bytes"] = data["max_allocated_bytes"]
    else:
        resident_bytes = (
            _storage_bytes(torch, _tensors_of(torch, resident)) if resident is not None else None
        )
        step_peak = _cpu_step_peak(torch, step_fn)
        data["step_peak_bytes"] = int(step_peak)
        data["resident_bytes"] = resident_bytes
        data["peak_bytes"] = int(step_peak + (resident_bytes or 0))
        for _ in range(steps):
            t0 = time.perf_counter()
            step_fn()
            times.append(time.perf_counter() - t0)
    s = sorted(times)
    data["step_times_s"] = times
    data["p50_s"] = _percentile(s, 50)
    data["p95_s"] = _percentile(s, 95)
    data["p99_s"] = _percentile(s, 99)
    data["conditions"] = {
        "torch": str(getattr(torch, "__version__", "?")),
        "cuda": getattr(getattr(torch, "version", None), "cuda", None),
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if is_cuda else "cpu",
        "dtype": _dtype_of(torch, resident, dtype),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        or os.environ.get("PYTORCH_ALLOC_CONF"),
        "threads": int(torch.get_num_threads()),
        "warmup": warmup,
        "steps": steps,
        "method": (
            "torch.cuda reset_peak_memory_stats after warm-up; max_memory_allocated, "
            "max_memory_reserved over the measured steps; mem_get_info"
            if is_cuda
            else "one step under torch.profiler (profile_memory=True): the peak of the running "
            "sum of its [memory] events above the step's start (bench/torch_peer/measure.py), "
            "plus the storages resident= holds; the timed steps run without the profiler"
        ),
    }
    return Measurement(data)


# ----------------------------------------------------------------------------------------------
# compare


class Comparison:
    """Prediction and measurement side by side: ``rows`` of (what, predicted, measured, ratio
    predicted / measured)."""

    def __init__(self, rows: List[Dict[str, Any]], measured: Measurement, title: str):
        self.rows = rows
        self.measured = measured
        self.title = title

    def ratio(self, what: str) -> Optional[float]:
        for r in self.rows:
            if r["what"] == what:
                return r["ratio"]
        raise KeyError(what)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "title": self.title,
            "rows": copy.deepcopy(self.rows),
            "measured": self.measured.to_dict(),
        }

    def __repr__(self) -> str:
        width = max([len(r["what"]) for r in self.rows] + [4])
        out = [self.title, f"  {'':<{width}}  {'predicted':>10}  {'measured':>10}  {'ratio':>6}"]
        for r in self.rows:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
            out.append(
                f"  {r['what']:<{width}}  {fmt_bytes(r['predicted']):>10}  "
                f"{fmt_bytes(r['measured']):>10}  {ratio:>6}"
            )
        c = self.measured.conditions
        out.append(
            f"  measured: torch {c.get('torch')}, {c.get('device_name')}, "
            f"{len(self.measured.step_times_s)} steps after {c.get('warmup')} warm-up"
        )
        return "\n".join(out)

    def _repr_html_(self) -> str:
        rows = [
            [
                r["what"],
                fmt_bytes(r["predicted"]),
                fmt_bytes(r["measured"]),
                "-" if r["ratio"] is None else f"{r['ratio']:.3f}",
            ]
            for r in self.rows
        ]
        return f"<div><b>{html_escape(self.title)}</b>" + html_table(
            rows, ["", "predicted", "measured", "pred / meas"]
        ) + "</div>"


def _row(what: str, predicted: Optional[int], measured: Optional[int]) -> Dict[str, Any]:
    ratio = predicted / measured if predicted is not None and measured else None
    return {"what": what, "predicted": predicted, "measured": measured, "ratio": ratio}


def compare(estimate: Any, measured: Measurement) -> Comparison:
    """Put ``estimate`` (a :class:`ditmem.Estimate`, a :class:`ditmem.Plan`, or their
    ``to_dict()``) beside ``measured``: on CUDA the allocator's maxima (allocated, reserved) and
    the device's use; on the CPU the peak. Ratio = predicted / measured."""
    data = estimate.to_dict() if hasattr(estimate, "to_dict") else dict(estimate)
    rows: List[Dict[str, Any]] = []
    if "feasible" in data:  # a plan
        title = "plan vs measured"
        rows.append(_row("peak (allocated)", data.get("predicted_peak_bytes"), measured.peak_bytes))
    else:
        title = "estimate vs measured"
        cuda = data.get("cuda") or {}
        if measured.device.startswith("cuda"):
            rows.append(
                _row("max allocated", cuda.get("max_allocated_bytes"), measured.max_allocated_bytes)
            )
            rows.append(
                _row("max reserved", cuda.get("max_reserved_bytes"), measured.max_reserved_bytes)
            )
            rows.append(
                _row("device (nvidia-smi)", cuda.get("device_bytes"), measured.device_used_bytes)
            )
        else:
            rows.append(_row("peak (allocated)", data.get("peak_bytes"), measured.peak_bytes))
    return Comparison(rows, measured, title)


# ----------------------------------------------------------------------------------------------
# snapshot


@contextlib.contextmanager
def snapshot(
    path: Union[str, "os.PathLike[str]"], max_entries: int = DEFAULT_MAX_ENTRIES
) -> Iterator[None]:
    """Record the CUDA caching allocator's history inside the block and dump it to ``path``
    (``torch.cuda.memory._dump_snapshot``), the file ``ditmem compare --snapshot PATH`` reads.

    Start it after the model is on the device and before the first step, so the snapshot's
    segments hold the model and its trace the steps. On the CPU it raises
    :class:`SnapshotUnavailable`: there is no caching allocator to record."""
    torch = _import_torch()
    if not torch.cuda.is_available():
        raise SnapshotUnavailable(
            "snapshot records the CUDA caching allocator (torch.cuda.memory._record_memory_history) "
            "and this torch has no CUDA device; run the step on a GPU, or use measure() for the "
            "CPU's peak"
        )
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(os.fspath(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
