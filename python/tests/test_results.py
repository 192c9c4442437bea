"""Typed results: repr (the answer first), _repr_html_ (a table and the device bar), plan
exports equal to `ditmem plan --emit TARGET`, write_exports."""

from __future__ import annotations

import pytest

import ditmem
from conftest import flags, run_cli


def test_estimate_repr_and_html():
    e = ditmem.estimate(model="dit-s-2", gpu="rtx-4090")
    lines = repr(e).splitlines()
    assert lines[0].startswith("DiT-S/2 256×256 (256 tokens), batch 32; bf16-mixed")
    assert lines[1].startswith("fits rtx-4090") and ": yes" in lines[1]
    assert lines[2].startswith("device peak: ")
    assert lines[3].startswith("biggest: activations")
    html = e._repr_html_()
    assert "<table" in html and "width:" in html  # the table and the bar
    assert e.allocated_bytes == e.peak_bytes == e.to_dict()["peak_bytes"]
    assert e.to_dict() is not e.to_dict()  # a copy


def test_estimate_without_a_card():
    e = ditmem.estimate(model="dit-s-2")
    assert e.fits is None and e.gpu is None
    assert "device peak" in repr(e)


@pytest.mark.parametrize("target", ditmem.EXPORT_TARGETS)
def test_plan_exports_are_the_clis(target, tmp_path):
    kw = {"model": "pixart-sigma-1024", "gpu": "rtx-4090", "allow": ["lora"]}
    out = tmp_path / "cli-export"
    rc, _, err = run_cli("plan", flags(dict(kw, emit=target, emit_out=str(out))))
    assert rc == 0, err
    p = ditmem.plan(**kw)
    assert p.export(target).text == out.read_text()


def test_plan_repr_html_and_write_exports(tmp_path):
    p = ditmem.plan(model="pixart-sigma-1024", gpu="rtx-4090", allow=["lora"], emit="diffusers")
    assert p.feasible and p.to_dict()["export"]["target"] == "diffusers"
    assert repr(p).splitlines()[0].startswith("plan for ")
    assert "fits: yes" in repr(p)
    assert "<table" in p._repr_html_()
    written = p.write_exports(tmp_path)
    assert len(written) == len(ditmem.EXPORT_TARGETS)
    assert all(w.exists() and w.stat().st_size > 0 for w in written)
    assert set(p.exports) == set(ditmem.EXPORT_TARGETS)


def test_params_and_gpus_repr():
    p = ditmem.params(model="flux.1-dev")
    assert repr(p).startswith("flux.1-dev: FluxTransformer2DModel (family flux)")
    assert "<table" in p._repr_html_()
    g = ditmem.gpus()
    assert len(g) >= 10 and g[0].capacity_bytes > 0
    assert "h100" in repr(g)
