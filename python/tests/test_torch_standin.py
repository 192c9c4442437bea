"""ditmem.torch against a stand-in torch that records calls (no torch in CI; python/test.sh
installs none). The real-torch test below runs only where torch imports."""

from __future__ import annotations

import sys
import types

import pytest

import ditmem
import ditmem.torch as dt


class Dev:
    def __init__(self, type_, index=None):
        self.type, self.index = type_, index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


class Event:
    def __init__(self, name, ts, n):
        self._name, self._ts, self._n = name, ts, n

    def name(self):
        return self._name

    def start_ns(self):
        return self._ts

    def nbytes(self):
        return self._n


def fake_torch(log, cuda=True, events=()):
    t = types.ModuleType("torch")
    t.__version__ = "9.9.9+fake"
    t.version = types.SimpleNamespace(cuda="12.8" if cuda else None)

    def device(kind, index=None):
        if isinstance(kind, str) and ":" in kind:
            kind, index = kind.split(":")[0], int(kind.split(":")[1])
        return Dev(kind, index)

    t.device = device
    t.is_tensor = lambda x: False
    t.get_num_threads = lambda: 7
    c = types.SimpleNamespace()
    c.is_available = lambda: cuda
    c.current_device = lambda: 0
    c.synchronize = lambda d=None: log.append(("synchronize",))
    c.reset_peak_memory_stats = lambda d: log.append(("reset_peak_memory_stats", str(d)))
    c.memory_allocated = lambda d: 1000
    c.max_memory_allocated = lambda d: log.append(("max_memory_allocated",)) or 5000
    c.max_memory_reserved = lambda d: 6144
    c.mem_get_info = lambda d: (10_000, 16_384)
    c.get_device_name = lambda d: "Fake GPU"
    c.memory = types.SimpleNamespace(
        _record_memory_history=lambda **kw: log.append(("_record_memory_history", kw)),
        _dump_snapshot=lambda path: log.append(("_dump_snapshot", path)),
    )
    t.cuda = c
    prof_mod = types.ModuleType("torch.profiler")
    prof_mod.ProfilerActivity = types.SimpleNamespace(CPU="CPU")

    class Profile:
        def __init__(self, activities, profile_memory):
            log.append(("profile", tuple(activities), profile_memory))
            self.profiler = types.SimpleNamespace(
                kineto_results=types.SimpleNamespace(events=lambda: list(events))
            )

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    prof_mod.profile = Profile
    t.profiler = prof_mod
    return t


@pytest.fixture
def install(monkeypatch):
    def go(log, **kw):
        t = fake_torch(log, **kw)
        monkeypatch.setitem(sys.modules, "torch", t)
        monkeypatch.setitem(sys.modules, "torch.profiler", t.profiler)
        monkeypatch.setattr(dt, "_import_torch", lambda: t)
        return t

    return go


def test_cuda_measure_resets_after_warmup_and_reads_the_counters(install):
    log = []
    install(log, cuda=True)
    step = lambda: log.append(("step",))  # noqa: E731
    m = dt.measure(step, warmup=2, steps=3)
    names = [e[0] for e in log]
    # two warm-up steps, then the reset, then three measured steps, then the maxima
    first_reset = names.index("reset_peak_memory_stats")
    assert names[:first_reset].count("step") == 2
    assert names[first_reset:].count("step") == 3
    assert names.index("max_memory_allocated") > len(names) - 3
    assert log[first_reset][1] == "cuda:0"
    assert (m.max_allocated_bytes, m.max_reserved_bytes) == (5000, 6144)
    assert (m.device_used_bytes, m.device_total_bytes) == (16_384 - 10_000, 16_384)
    assert m.allocated_before_bytes == 1000 and m.peak_bytes == 5000
    assert len(m.step_times_s) == 3 and m.p50_s <= m.p95_s <= m.p99_s
    c = m.conditions
    assert c["torch"] == "9.9.9+fake" and c["device_name"] == "Fake GPU" and c["threads"] == 7
    assert "reserved" in repr(m) and "Fake GPU" in repr(m)


def test_cpu_measure_is_the_profilers_running_sum(install, monkeypatch):
    log = []
    # out of time order on purpose: the running sum is taken in time order
    events = [
        Event("[memory]", 4, 200),
        Event("[memory]", 1, 100),
        Event("aten::mm", 2, 999_999),
        Event("[memory]", 3, -100),
        Event("[memory]", 2, 50),
    ]
    install(log, cuda=False, events=events)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    m = dt.measure(lambda: log.append(("step",)), warmup=1, steps=2, dtype="torch.bfloat16")
    # 100, 150, 50, 250 → 250
    assert m.step_peak_bytes == 250 and m.peak_bytes == 250 and m.resident_bytes is None
    assert [e[0] for e in log].count("step") == 1 + 1 + 2  # warm-up, profiled, timed
    assert ("profile", ("CPU",), True) in log
    assert m.device == "cpu" and m.max_allocated_bytes is None
    assert m.conditions["alloc_conf"] == "expandable_segments:True"
    assert m.conditions["dtype"] == "bfloat16"
    cmp = dt.compare({"peak_bytes": 500, "cuda": {}}, m)
    assert cmp.ratio("peak (allocated)") == 2.0
    assert "estimate vs measured" in repr(cmp) and "2.000" in repr(cmp)


def test_compare_cuda_rows_against_an_estimate(install):
    log = []
    install(log, cuda=True)
    m = dt.measure(lambda: None, warmup=0, steps=1)
    e = ditmem.estimate(model="dit-s-2", resolution=64, batch=2, gpu="h100-sxm")
    cmp = dt.compare(e, m)
    cu = e.to_dict()["cuda"]
    assert cmp.ratio("max allocated") == cu["max_allocated_bytes"] / 5000
    assert cmp.ratio("max reserved") == cu["max_reserved_bytes"] / 6144
    assert cmp.ratio("device (nvidia-smi)") == cu["device_bytes"] / (16_384 - 10_000)
    assert "<table" in cmp._repr_html_()
    assert cmp.to_dict()["rows"][0]["what"] == "max allocated"
    p = ditmem.plan(model="dit-s-2", resolution=64, batch=2, gpu="h100-sxm")
    assert dt.compare(p, m).ratio("peak (allocated)") == p.predicted_peak_bytes / 5000


def test_snapshot_records_then_dumps(install, tmp_path):
    log = []
    install(log, cuda=True)
    path = tmp_path / "snap.pickle"
    with dt.snapshot(path, max_entries=123):
        log.append(("step",))
    names = [e[0] for e in log]
    assert names == ["_record_memory_history", "step", "synchronize", "_dump_snapshot",
                     "_record_memory_history"]
    assert log[0][1] == {"max_entries": 123, "stacks": "python"}
    assert log[3][1] == str(path)
    assert log[4][1] == {"enabled": None}


def test_snapshot_stops_recording_when_the_step_fails(install, tmp_path):
    log = []
    install(log, cuda=True)
    with pytest.raises(KeyError):
        with dt.snapshot(tmp_path / "s.pickle"):
            raise KeyError("x")
    assert log[-1] == ("_record_memory_history", {"enabled": None})
    assert "_dump_snapshot" not in [e[0] for e in log]


def test_snapshot_on_cpu_is_a_clear_error(install, tmp_path):
    install([], cuda=False)
    with pytest.raises(dt.SnapshotUnavailable) as e:
        with dt.snapshot(tmp_path / "s.pickle"):
            pass
    assert "CUDA" in str(e.value)


def test_bad_counts_and_percentiles():
    with pytest.raises(ValueError):
        dt.measure(lambda: None, steps=0)
    xs = [float(i) for i in range(1, 101)]
    assert (dt._percentile(xs, 50), dt._percentile(xs, 95), dt._percentile(xs, 99)) == (50, 95, 99)
    assert dt._percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert dt._percentile([1.0, 2.0, 3.0], 99) == 3.0
    assert dt._percentile([], 50) is None


def test_real_torch_on_cpu_where_installed():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)

    def step():
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    m = dt.measure(step, warmup=1, steps=3, device="cpu", resident=[model, opt])
    weights = sum(p.numel() * 4 for p in model.parameters())
    # weights + AdamW's m and v (+ its 0-dim step counters); grads are None after zero_grad
    assert 3 * weights <= m.resident_bytes <= 3 * weights + 64 * 8
    assert m.step_peak_bytes >= 32 * 256 * 4  # at least the hidden activation
    assert m.conditions["dtype"] == "float32"
    if not torch.cuda.is_available():
        with pytest.raises(dt.SnapshotUnavailable):
            with dt.snapshot("s.pickle"):
                pass
