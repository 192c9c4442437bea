"""ditmem for Python: budget and plan the memory of a diffusion-transformer training step.

Every function runs the very command the ``ditmem`` CLI runs (the Rust crates, through
``ditmem._native``), with keyword arguments named as the CLI's flags (``lora_rank=16`` is
``--lora-rank 16``, ``allow=["lora", "8bit"]`` is ``--allow lora,8bit``, ``ema=False`` is
``--ema off``, ``verbose=True`` is ``--verbose``). Each result's ``to_dict()`` is the CLI's
``--json`` output.

>>> import ditmem
>>> e = ditmem.estimate(model="flux.1-dev", lora_rank=16, recompute="all", gpu="rtx-4090")
>>> e.fits, e.need_bytes
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from . import _native
from ._format import fmt_bytes, fmt_secs, html_bar, html_escape, html_table

__all__ = [
    "estimate",
    "plan",
    "params",
    "gpus",
    "oom",
    "spec",
    "presets",
    "argument_names",
    "Estimate",
    "Plan",
    "Export",
    "Params",
    "Gpu",
    "Gpus",
    "OomReport",
    "Lever",
    "DitmemError",
    "InvalidInput",
    "ModelMismatch",
    "DoesNotFit",
    "MissingTool",
    "InternalError",
]

__version__: str = _native.__version__

#: The export targets `plan(emit=...)` takes (`ditmem plan --emit`).
EXPORT_TARGETS = ("accelerate", "deepspeed", "deepspeed-standalone", "diffusers")

# ----------------------------------------------------------------------------------------------
# Errors


class DitmemError(Exception):
    """A ditmem command failed; ``message`` is the CLI's one line (after ``ditmem: ``) and
    ``exit_code`` the code the CLI exits with."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidInput(DitmemError, ValueError):
    """Bad input (CLI exit 2): an unknown argument, a value out of range, a bad config."""

    exit_code = 2


class ModelMismatch(InvalidInput):
    """A live model's own parameter count differs from ditmem's count of its config."""

    def __init__(self, message: str, model_count: int, ditmem_count: int):
        super().__init__(message)
        self.model_count = model_count
        self.ditmem_count = ditmem_count


class DoesNotFit(DitmemError):
    """Nothing fits (CLI exit 3). ``smallest_peak_bytes`` is the smallest peak the plan's
    search reached (``predicted_peak_bytes`` of its JSON), ``json`` the command's JSON."""

    exit_code = 3

    def __init__(self, message: str, json_value: Optional[dict]):
        super().__init__(message)
        self.json = json_value
        # The arguments of the call that raised it, set by the function that made the call
        # (`plan`), so that `.plan` can show the CLI's text for the same spec.
        self._kwargs: Optional[Dict[str, Any]] = None
        self.smallest_peak_bytes: Optional[int] = (
            json_value.get("predicted_peak_bytes") if isinstance(json_value, dict) else None
        )

    @property
    def plan(self) -> Optional["Plan"]:
        """The infeasible plan (its reason, Pareto front, smallest peak) as a :class:`Plan`."""
        if isinstance(self.json, dict) and "feasible" in self.json:
            return Plan(self.json, self._kwargs)
        return None


class MissingTool(DitmemError):
    """A needed external tool is missing (CLI exit 5)."""

    exit_code = 5


class InternalError(DitmemError, RuntimeError):
    """Anything else (CLI exit 1)."""


def _raise(err: "_native.NativeError") -> None:
    kind, message, json_text = err.args
    if kind == "invalid":
        raise InvalidInput(message) from None
    if kind == "does_not_fit":
        raise DoesNotFit(message, json.loads(json_text) if json_text else None) from None
    if kind == "missing":
        raise MissingTool(message) from None
    raise InternalError(message) from None


# ----------------------------------------------------------------------------------------------
# Arguments


def _jsonable(value: Any, key: str) -> Any:
    """A keyword argument as JSON: paths as strings, tuples and sets as lists, mappings (a
    diffusers FrozenDict) as objects."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, key) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, key) for v in value]
    # numpy / torch scalars
    item = getattr(value, "item", None)
    if callable(item):
        return _jsonable(item(), key)
    raise InvalidInput(
        f"invalid input: {key}: a {type(value).__name__} given; allowed: a string, a number, "
        "a boolean, a list or (for model) a config dict"
    )


def _is_live_model(obj: Any) -> bool:
    return (
        not isinstance(obj, (str, bytes, os.PathLike, Mapping))
        and hasattr(obj, "config")
        and callable(getattr(obj, "parameters", None))
    )


def _config_of(model: Any) -> dict:
    """A live diffusers model's config as a plain dict (a FrozenDict is a mapping), with its
    class name as `_class_name` when the config lacks it (diffusers adds it only when saving:
    `ConfigMixin.to_json_string`)."""
    cfg = model.config
    if not isinstance(cfg, Mapping):
        to_dict = getattr(cfg, "to_dict", None)
        if callable(to_dict):
            cfg = to_dict()
        else:
            raise InvalidInput(
                f"invalid input: model: a {type(model).__name__} whose .config is a "
                f"{type(cfg).__name__}; allowed: a model whose config is a mapping "
                "(a diffusers ModelMixin)"
            )
    out = _jsonable(cfg, "model")
    out.setdefault("_class_name", type(model).__name__)
    return out


def _model_numel(model: Any) -> int:
    return int(sum(int(p.numel()) for p in model.parameters()))


def _native_answer(native: Any, command: str, kwargs: Dict[str, Any]) -> str:
    """``native`` (``_native.call`` or ``_native.text``) on ``command`` with ``kwargs``; its
    failure as the typed error."""
    args = {k: _jsonable(v, k) for k, v in kwargs.items()}
    try:
        return native(command, json.dumps(args))
    except _native.NativeError as e:
        _raise(e)
        raise  # unreachable: _raise always raises


def _call(command: str, kwargs: Dict[str, Any]) -> Any:
    """The command's ``--json`` value."""
    return json.loads(_native_answer(_native.call, command, kwargs))


def _text(command: str, kwargs: Dict[str, Any]) -> str:
    """The text the CLI prints for ``command`` (no ``--json``)."""
    return _native_answer(_native.text, command, kwargs)


def _prepare(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Resolve `model=`: a live model becomes its config dict, after its own parameter count
    is held against ditmem's count of that config (a mismatch is an error, never a silent
    estimate)."""
    model = kwargs.get("model")
    if model is not None and _is_live_model(model):
        cfg = _config_of(model)
        own = _model_numel(model)
        counted = _call("params", {"model": cfg})["params"]["total"]
        if own != counted:
            raise ModelMismatch(
                f"invalid input: model: the {type(model).__name__} given has {own:,} parameters "
                f"(sum of p.numel() over model.parameters()), ditmem counts {counted:,} for its "
                "config; an estimate of a different model would mislead (adapters already "
                "injected, a modified module, or a family ditmem reads differently)",
                own,
                counted,
            )
        kwargs = dict(kwargs, model=cfg)
    return kwargs


# ----------------------------------------------------------------------------------------------
# Results


class Result:
    """A command's answer: ``to_dict()`` is the CLI's ``--json`` value; items read through."""

    def __init__(self, data: Any, kwargs: Optional[Dict[str, Any]] = None):
        self._data = data
        self._kwargs = dict(kwargs or {})

    def to_dict(self) -> Any:
        """The CLI's ``--json`` value (a deep copy)."""
        return copy.deepcopy(self._data)

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self._data, indent=indent, ensure_ascii=False)

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._data == self._data  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]

    def __str__(self) -> str:
        return self.__repr__()


class Lever:
    """One change `estimate` offers (its `levers` entry)."""

    def __init__(self, data: dict):
        self._data = data
        self.lever: str = data.get("lever", "")
        self.change: str = data.get("change", "")
        self.flags: str = data.get("flags", "")
        self.device_peak_bytes: Optional[int] = data.get("device_peak_bytes")
        self.allocated_peak_bytes: Optional[int] = data.get("allocated_peak_bytes")
        self.fits: Optional[bool] = data.get("fits")
        self.step_time_s: Optional[float] = data.get("step_time_s")
        self.slowdown: Optional[float] = data.get("slowdown")
        self.note: Optional[str] = data.get("note")

    def to_dict(self) -> dict:
        return copy.deepcopy(self._data)

    def __repr__(self) -> str:
        step = f", step ×{1 + self.slowdown:.2f}" if self.slowdown is not None else ""
        return f"Lever({self.flags} → {fmt_bytes(self.device_peak_bytes)}{step})"


def _spec_line(spec: dict, tokens: Optional[int] = None) -> str:
    model = spec.get("model", {}) or {}
    wl = spec.get("workload", {}) or {}
    rec = spec.get("recipe", {}) or {}
    parts = [f"{model.get('name', '?')} {wl.get('height', '?')}×{wl.get('width', '?')}"]
    if tokens is not None:
        parts[0] += f" ({tokens:,} tokens)"
    parts[0] += f", batch {wl.get('batch', '?')}"
    recipe = [str(rec.get("precision", "?"))]
    lora = rec.get("lora")
    if isinstance(lora, dict) and lora.get("rank"):
        recipe.append(f"LoRA rank {lora['rank']}")
    rc = rec.get("recompute")
    if rc not in (None, "none"):
        recipe.append(f"recompute {rc if isinstance(rc, str) else json.dumps(rc)}")
    line = f"{parts[0]}; {', '.join(recipe)}"
    gpu = (spec.get("cuda") or {}).get("gpu")
    if gpu:
        line += f"; on {gpu}"
    return line


def _biggest(breakdown: Mapping[str, int], total: int, n: int = 3) -> str:
    items = sorted(((v, k) for k, v in breakdown.items() if v), reverse=True)[:n]
    if not total:
        return ""
    return " · ".join(
        f"{k.replace('_', ' ')} {fmt_bytes(v)} {100 * v / total:.0f} %" for v, k in items
    )


class Estimate(Result):
    """`ditmem estimate`: every byte of one training step and its peak.

    Attributes: ``fits`` (None when no card was named), ``gpu``, ``peak_bytes`` (the step's
    tensors at the peak), ``peak_phase``, ``peak_label``, ``breakdown`` (at the peak),
    ``max_allocated_bytes`` / ``max_reserved_bytes`` (the caching allocator's maxima, as
    ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` report them),
    ``context_bytes``, ``device_bytes`` (as nvidia-smi shows it), ``capacity_bytes`` (the card as
    CUDA reports it), ``need_bytes`` (what the step needs of the card), ``levers``, ``params``.
    """

    def __init__(self, data: dict, kwargs: Optional[Dict[str, Any]] = None):
        super().__init__(data, kwargs)
        cuda = data.get("cuda") or {}
        peak = data.get("peak") or {}
        self.spec: dict = data.get("spec", {})
        self.fits: Optional[bool] = data.get("fits")
        self.gpu: Optional[str] = cuda.get("gpu")
        self.tokens: Optional[int] = data.get("tokens")
        self.peak_bytes: int = data.get("peak_bytes", 0)
        self.peak_phase: Optional[str] = data.get("peak_phase")
        self.peak_label: Optional[str] = peak.get("label")
        self.breakdown: Dict[str, int] = dict(peak.get("breakdown") or data.get("breakdown") or {})
        self.max_allocated_bytes: Optional[int] = cuda.get("max_allocated_bytes")
        self.max_reserved_bytes: Optional[int] = cuda.get("max_reserved_bytes")
        self.context_bytes: Optional[int] = cuda.get("context_bytes")
        self.device_bytes: Optional[int] = cuda.get("device_bytes")
        self.capacity_bytes: Optional[int] = cuda.get("capacity_bytes")
        self.need_bytes: Optional[int] = data.get("need_bytes")
        self.oom: Optional[dict] = cuda.get("oom")
        self.levers: List[Lever] = [Lever(x) for x in data.get("levers") or []]
        self.params: dict = data.get("params", {})
        self._answer: Optional[List[str]] = None

    @property
    def allocated_bytes(self) -> int:
        """The allocated peak: the step's live tensors at its peak."""
        return self.peak_bytes

    # Flags that only add to the report or write a file: the answer is read without them.
    _NOT_THE_ANSWER = ("inventory", "verbose", "timeline", "plot")

    def lines(self) -> List[str]:
        """The CLI's answer, its first five lines: the spec, whether it fits, the device peak,
        the biggest categories and the one change (from the same code as ``ditmem estimate``,
        run again without ``--json`` the first time they are asked for)."""
        if self._answer is None:
            kwargs = {k: v for k, v in self._kwargs.items() if k not in self._NOT_THE_ANSWER}
            self._answer = _text("estimate", kwargs).splitlines()[:5]
        return list(self._answer)

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        rows = [
            ["fits", "-" if self.fits is None else ("yes" if self.fits else "no")],
            ["peak (allocated)", fmt_bytes(self.peak_bytes)],
            ["max allocated", fmt_bytes(self.max_allocated_bytes)],
            ["max reserved", fmt_bytes(self.max_reserved_bytes)],
            ["device (nvidia-smi)", fmt_bytes(self.device_bytes)],
            ["needs", fmt_bytes(self.need_bytes)],
        ]
        total = self.peak_bytes or 1
        rows += [
            [f"  {k.replace('_', ' ')}", f"{fmt_bytes(v)} ({100 * v / total:.0f} %)"]
            for k, v in sorted(self.breakdown.items(), key=lambda kv: -kv[1])
            if v
        ]
        return (
            f"<div><b>{html_escape(_spec_line(self.spec, self.tokens))}</b>"
            + html_bar(self.need_bytes, self.capacity_bytes, self.gpu or "device")
            + html_table(rows, ["", "bytes"])
            + "</div>"
        )


class Export:
    """A plan exported for a training stack (`ditmem plan --emit TARGET`)."""

    def __init__(self, data: dict):
        self._data = data
        self.target: str = data.get("target", "")
        self.file_name: str = data.get("file_name", "")
        self.text: str = data.get("text", "")
        self.notes: List[str] = list(data.get("notes") or [])
        # What the launch cannot do as planned (the run will differ from the plan).
        self.cannot: List[str] = list(data.get("cannot") or [])

    def to_dict(self) -> dict:
        return copy.deepcopy(self._data)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Export({self.target}: {self.file_name}, {len(self.text)} characters)"


class Plan(Result):
    """`ditmem plan`: the fastest recipe that fits the budget, and why.

    ``recipe`` is the planned spec (a dict; ``ditmem run --config`` reads it as TOML via
    ``plan(out=PATH)``), ``changes`` the changes from the spec given, ``reason`` why,
    ``exports`` the plan for accelerate / DeepSpeed / the diffusers script as text."""

    def __init__(self, data: dict, kwargs: Optional[Dict[str, Any]] = None):
        super().__init__(data, kwargs)
        self.feasible: bool = bool(data.get("feasible"))
        self.recipe: dict = data.get("plan", {})
        self.changes: List[str] = list(data.get("changes") or [])
        self.reason: str = data.get("reason", "")
        self.predicted_peak_bytes: Optional[int] = data.get("predicted_peak_bytes")
        self.predicted_step_time_s: Optional[float] = data.get("predicted_step_time_s")
        self.breakdown: Dict[str, int] = dict(data.get("breakdown") or {})
        self.budget_bytes: Optional[int] = data.get("budget_bytes")
        self.usable_bytes: Optional[int] = data.get("usable_bytes")
        self.headroom: Optional[float] = data.get("headroom")
        self.base_peak_bytes: Optional[int] = data.get("base_peak_bytes")
        self.base_step_time_s: Optional[float] = data.get("base_step_time_s")
        self._answer: Optional[List[str]] = None
        # Whether the call's arguments are known (not a plan rebuilt from its JSON alone).
        self._called = kwargs is not None
        self._exports: Dict[str, Export] = {}
        if isinstance(data.get("export"), dict):
            e = Export(data["export"])
            self._exports[e.target] = e

    def export(self, target: str) -> Export:
        """The plan exported for `target` (accelerate, deepspeed, deepspeed-standalone,
        diffusers): the same plan run again with ``emit=target`` (a plan is deterministic)."""
        if target not in self._exports:
            kw = {k: v for k, v in self._kwargs.items() if not k.startswith("emit")}
            kw["emit"] = target
            data = _call("plan", kw)
            if not isinstance(data.get("export"), dict):
                raise InternalError(f"`plan --emit {target} --json` printed no export")
            self._exports[target] = Export(data["export"])
        return self._exports[target]

    @property
    def exports(self) -> Dict[str, str]:
        """Every export target's text, by target name."""
        return {t: self.export(t).text for t in EXPORT_TARGETS}

    def write_exports(self, directory: Union[str, os.PathLike], targets: Sequence[str] = EXPORT_TARGETS) -> List[Path]:
        """Write each export under `directory` by its file name (accelerate_config.yaml,
        ds_config.json, train.sh, …); returns the paths written. A target whose file name
        another already took is written as `<target>-<file name>`."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        written: List[Path] = []
        for t in targets:
            e = self.export(t)
            path = d / e.file_name
            if path in written:
                path = d / f"{t}-{e.file_name}"
            path.write_text(e.text, encoding="utf-8")
            written.append(path)
        return written

    # Flags that only add to the report, export or write a file: the answer is read without.
    _NOT_THE_ANSWER = ("verbose", "plot", "emit", "emit_out", "emit_dir", "out")

    def lines(self) -> List[str]:
        """The CLI's answer: the lines `ditmem plan` prints before its Pareto front (the spec,
        whether it fits, the step, the biggest categories, the changes, a short why, the flags),
        from the same code, run again without ``--json`` the first time they are asked for. A
        plan made without its call's arguments (built from a JSON value) says the same from its
        fields."""
        if self._answer is None:
            if not self._called:
                self._answer = self._lines_from_fields()
            else:
                kwargs = {k: v for k, v in self._kwargs.items() if k not in self._NOT_THE_ANSWER}
                self._answer = _text("plan", kwargs).split("\n\n")[0].splitlines()
        return list(self._answer)

    def _lines_from_fields(self) -> List[str]:
        spec = self.recipe or {}
        out = [f"plan for {_spec_line(spec)}"]
        if self.feasible:
            out.append(
                f"fits: yes — {fmt_bytes(self.predicted_peak_bytes)} of "
                f"{fmt_bytes(self.usable_bytes)} usable"
            )
        else:
            out.append(
                f"fits: no — nothing fits {fmt_bytes(self.usable_bytes)} usable; the smallest "
                f"found needs {fmt_bytes(self.predicted_peak_bytes)}"
            )
        out.append(f"step: {fmt_secs(self.predicted_step_time_s)} predicted")
        big = _biggest(self.breakdown, self.predicted_peak_bytes or 0)
        if big:
            out.append(f"biggest: {big}")
        out.append(f"changes: {' · '.join(self.changes) if self.changes else 'none'}")
        out.append(f"why: {self.reason}")
        return out

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        rows = [
            ["fits", "yes" if self.feasible else "no"],
            ["predicted peak", fmt_bytes(self.predicted_peak_bytes)],
            ["usable", fmt_bytes(self.usable_bytes)],
            ["step", fmt_secs(self.predicted_step_time_s)],
            ["changes", " · ".join(self.changes) or "none"],
        ]
        return (
            f"<div><b>plan for {html_escape(_spec_line(self.recipe or {}))}</b>"
            + html_bar(self.predicted_peak_bytes, self.budget_bytes, "budget")
            + html_table(rows)
            + f"<p>{html_escape(self.reason)}</p></div>"
        )


class Params(Result):
    """`ditmem params`: the parameter count of a model, per module group."""

    def __init__(self, data: dict, kwargs: Optional[Dict[str, Any]] = None):
        super().__init__(data, kwargs)
        model = data.get("model") or {}
        p = data.get("params") or {}
        self.name: Optional[str] = model.get("name")
        self.family: Optional[str] = model.get("family")
        self.class_name: Optional[str] = model.get("class_name")
        self.total: int = p.get("total", 0)
        self.trainable: Optional[int] = p.get("trainable")
        self.buffers: Optional[int] = p.get("buffers")
        self.tensors: Optional[int] = p.get("tensors")
        self.per_group: List[dict] = list(p.get("per_group") or [])
        self.state: List[dict] = list(data.get("state") or [])

    def lines(self) -> List[str]:
        out = [f"{self.name}: {self.class_name} (family {self.family})"]
        out.append(
            f"  {self.total:,} parameters ({self.trainable:,} trainable), "
            f"{self.buffers or 0:,} buffer elements, {self.tensors} tensors"
        )
        for s in self.state:
            out.append(f"  {s.get('recipe')}: {fmt_bytes(s.get('bytes'))}")
        return out

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        rows = [[g.get("name"), f"{g.get('parameters', 0):,}"] for g in self.per_group]
        rows.append(["total", f"{self.total:,}"])
        return (
            f"<div><b>{html_escape(self.name)}: {html_escape(self.class_name)}</b>"
            + html_table(rows, ["module group", "parameters"])
            + "</div>"
        )


_MiB = 1 << 20


class Gpu(Result):
    """One card of `ditmem gpus`: capacity as CUDA reports it, FLOP/s, bandwidth, sources."""

    def __init__(self, data: dict):
        super().__init__(data)
        basis = data.get("capacity_basis") or {}
        self.name: str = data.get("name", "")
        self.aliases: List[str] = list(data.get("aliases") or [])
        self.product: Optional[str] = data.get("product")
        self.capacity_bytes: Optional[int] = basis.get("mib") * _MiB if basis.get("mib") else None
        self.capacity_basis: Optional[str] = basis.get("kind")
        self.compute_capability = tuple(data.get("compute_capability") or ())
        self.flops: Dict[str, Optional[float]] = dict(data.get("flops") or {})
        self.bandwidth: Optional[float] = data.get("bandwidth")
        self.context_bytes: Optional[int] = data.get("context_bytes")

    def __repr__(self) -> str:
        cc = ".".join(str(x) for x in self.compute_capability)
        return (
            f"{self.name}: {self.product}, {fmt_bytes(self.capacity_bytes)} "
            f"({self.capacity_basis}), sm {cc}"
        )


class Gpus(Result):
    """`ditmem gpus`: the GPU catalog (a sequence of :class:`Gpu`, also indexed by name)."""

    def __init__(self, data: list):
        super().__init__(data)
        self.items: List[Gpu] = [Gpu(x) for x in data]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Gpu]:
        return iter(self.items)

    def __getitem__(self, key: Union[int, str]) -> Gpu:  # type: ignore[override]
        if isinstance(key, int):
            return self.items[key]
        k = key.lower()
        for g in self.items:
            if g.name == k or k in g.aliases:
                return g
        raise KeyError(key)

    def __repr__(self) -> str:
        return "\n".join(repr(g) for g in self.items)

    def _repr_html_(self) -> str:
        rows = [
            [g.name, fmt_bytes(g.capacity_bytes), g.capacity_basis, g.product] for g in self.items
        ]
        return html_table(rows, ["gpu", "capacity", "basis", "product"])


class OomReport(Result):
    """`ditmem oom`: a PyTorch out-of-memory message read against the spec: ``cause``
    (fragmentation or a shortage), ``gpu`` (the catalog card the capacity matches),
    ``diagnosis``, ``levers`` and, with spec flags, ``agreement`` (prediction vs message)."""

    def __init__(self, data: dict, kwargs: Optional[Dict[str, Any]] = None):
        super().__init__(data, kwargs)
        self.message: dict = data.get("message") or {}
        self.diagnosis: dict = data.get("diagnosis") or {}
        self.cause: Optional[str] = self.diagnosis.get("cause")
        self.gpu: Optional[str] = data.get("gpu")
        self.levers: Any = data.get("levers")
        self.agreement: Optional[dict] = data.get("agreement")

    def __repr__(self) -> str:
        m = self.message
        out = [
            f"{m.get('backend', '?')} out of memory: tried to allocate "
            f"{fmt_bytes(m.get('requested_bytes'))} with {fmt_bytes(m.get('allocated_bytes'))} "
            f"allocated of {fmt_bytes(m.get('total_bytes'))}",
            f"cause: {self.cause}; card: {self.gpu or '-'}",
        ]
        if self.agreement and self.agreement.get("verdict"):
            out.append(f"spec: {self.agreement['verdict']}")
        return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Commands


def estimate(**kwargs: Any) -> Estimate:
    """`ditmem estimate`: count every byte of one training step and find its peak.

    Keyword arguments are the CLI's flags: ``model`` (a preset name, a config.json path or its
    folder, a config dict, or a live diffusers model), ``resolution``, ``batch``, ``lora_rank``,
    ``recompute``, ``precision``, ``optimizer``, ``gpu``, ... (``argument_names("estimate")``)."""
    kwargs = _prepare(kwargs)
    return Estimate(_call("estimate", kwargs), kwargs)


def plan(**kwargs: Any) -> Plan:
    """`ditmem plan`: the fastest recipe that fits ``budget=`` (or ``gpu=``'s capacity).

    Raises :class:`DoesNotFit` (with the smallest reachable peak) when nothing fits."""
    kwargs = _prepare(kwargs)
    try:
        return Plan(_call("plan", kwargs), kwargs)
    except DoesNotFit as e:
        e._kwargs = kwargs
        raise


def params(**kwargs: Any) -> Params:
    """`ditmem params`: the parameter count of ``model`` per module group."""
    kwargs = _prepare(kwargs)
    return Params(_call("params", kwargs), kwargs)


def gpus(name: Optional[str] = None) -> Gpus:
    """`ditmem gpus [NAME]`: the GPU catalog, or the one card ``name`` names."""
    return Gpus(_call("gpus", {"name": name}))


def oom(message: str, **kwargs: Any) -> OomReport:
    """`ditmem oom`: read a PyTorch CUDA out-of-memory message against the spec."""
    kwargs = _prepare(kwargs)
    return OomReport(_call("oom", dict(kwargs, message=message)), kwargs)


def spec(**kwargs: Any) -> dict:
    """`ditmem spec`: the resolved spec the flags describe, as a dict."""
    kwargs = _prepare(kwargs)
    return _call("spec", kwargs)


def presets() -> List[str]:
    """Every model preset name ``model=`` takes."""
    return list(_native.preset_names())


def argument_names(command: str) -> List[str]:
    """The keyword arguments `command` takes (the CLI's flags with underscores)."""
    try:
        return list(_native.argument_names(command))
    except _native.NativeError as e:
        _raise(e)
        raise  # unreachable
