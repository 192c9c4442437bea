"""The package's answers are the CLI's: to_dict() equals `ditmem CMD ... --json` of the release
binary, over every preset, for estimate, plan and params (and gpus)."""

from __future__ import annotations

import pytest

import ditmem
from conftest import flags, run_cli, strip_volatile

PRESETS = ditmem.presets()


def test_presets_are_the_clis():
    # The --preset help of the CLI names each diffusers checkpoint; the DiTs are dit-{s,b,l,xl}-{2,4,8}.
    assert len(PRESETS) == len(set(PRESETS))
    for name in ["dit-s-2", "dit-xl-2", "flux.1-dev", "sd3.5-large", "pixart-sigma-1024", "wan2.1-14b"]:
        assert name in PRESETS
    assert len(PRESETS) >= 25


@pytest.mark.parametrize("preset", PRESETS)
def test_estimate_equals_cli(preset):
    kw = {"model": preset, "gpu": "h100-sxm"}
    rc, want, err = run_cli("estimate", flags(kw))
    assert rc == 0, err
    got = ditmem.estimate(**kw)
    assert got.to_dict() == want
    assert got.need_bytes == want["need_bytes"]
    assert got.fits == want["fits"]


@pytest.mark.parametrize("preset", PRESETS)
def test_params_equals_cli(preset):
    rc, want, err = run_cli("params", flags({"model": preset}))
    assert rc == 0, err
    got = ditmem.params(model=preset)
    assert got.to_dict() == want
    assert got.total == want["params"]["total"] > 0


@pytest.mark.parametrize("preset", PRESETS)
def test_plan_equals_cli(preset):
    # A 24 GiB card with LoRA and 8-bit allowed: some presets fit, the largest do not (exit 3).
    kw = {"model": preset, "gpu": "rtx-4090", "allow": ["lora", "8bit"]}
    rc, want, err = run_cli("plan", flags(kw))
    assert rc in (0, 3), err
    if rc == 0:
        got = ditmem.plan(**kw)
        assert got.feasible
        assert strip_volatile(got.to_dict()) == strip_volatile(want)
    else:
        with pytest.raises(ditmem.DoesNotFit) as e:
            ditmem.plan(**kw)
        assert strip_volatile(e.value.json) == strip_volatile(want)
        assert e.value.smallest_peak_bytes == want["predicted_peak_bytes"]
        assert e.value.message == err.removeprefix("ditmem: ")


def test_estimate_with_the_issue_flags_equals_cli():
    kw = {"model": "flux.1-dev", "lora_rank": 16, "recompute": "all", "gpu": "rtx-4090",
          "resolution": 1024, "batch": 1}
    rc, want, err = run_cli("estimate", flags(kw))
    assert rc == 0, err
    e = ditmem.estimate(**kw)
    assert e.to_dict() == want
    assert e.fits is False
    assert e.max_reserved_bytes == want["cuda"]["max_reserved_bytes"]
    assert e.breakdown == want["peak"]["breakdown"]
    first = repr(e).splitlines()
    assert first[0].startswith("flux.1-dev 1024×1024 (4,096 tokens), batch 1")
    assert "rtx-4090" in first[1] and "no" in first[1]


def test_estimate_repr_is_the_clis_answer():
    # The first five lines the CLI prints, from the same code: the one change says whether it
    # fits (Flux LoRA at 1024² on a 4090: no single flag is enough), a verbose flag or a plot
    # file is not part of the answer (and no file is written by showing it).
    import subprocess
    from conftest import BIN

    for kw in (
        {"model": "flux.1-dev", "lora_rank": 16, "gpu": "rtx-4090"},
        {"model": "pixart-sigma-1024", "batch": 4, "gpu": "a100-40gb"},
        {"model": "dit-s-2"},
    ):
        cli = subprocess.run([BIN, "estimate", *flags(kw)], capture_output=True, text=True,
                             check=True).stdout.splitlines()[:5]
        e = ditmem.estimate(**kw, verbose=True)
        assert repr(e).splitlines() == cli
    e = ditmem.estimate(model="flux.1-dev", lora_rank=16, gpu="rtx-4090")
    assert "no one flag is enough" in repr(e) and "try ditmem plan --allow all" in repr(e)


def test_plan_repr_is_the_clis_answer(tmp_path):
    # What the CLI prints before its Pareto front, from the same code: the short why and the
    # flags to launch with (the package used to print the whole reason and no flags); an
    # export or a plot file is not part of the answer (and none is written by showing it); a
    # plan where nothing fits shows the CLI's text too, through the DoesNotFit it raises.
    import subprocess
    from conftest import BIN

    def cli_answer(kw):
        out = subprocess.run([BIN, "plan", *flags(kw)], capture_output=True, text=True)
        return out.stdout.split("\n\n")[0].splitlines()

    kw = {"model": "flux.1-dev", "lora_rank": 16, "gpu": "rtx-4090", "allow": "all"}
    plot = tmp_path / "front.svg"
    p = ditmem.plan(**kw, emit="accelerate", launcher="custom", plot=str(plot))
    plot.unlink()
    lines = repr(p).splitlines()
    assert lines == cli_answer(kw)
    assert lines[1].startswith("fits: yes") and any(x.startswith("flags: ") for x in lines)
    assert not plot.exists()
    kw = {"model": "flux.1-dev", "budget": "4GiB"}
    with pytest.raises(ditmem.DoesNotFit) as e:
        ditmem.plan(**kw)
    lines = repr(e.value.plan).splitlines()
    assert lines == cli_answer(kw) and lines[1].startswith("fits: no")
    # A plan rebuilt from its JSON alone says the same from its fields.
    alone = ditmem.Plan(p.to_dict())
    assert repr(alone).splitlines()[0].startswith("plan for flux.1-dev")


def test_gpus_equal_cli():
    rc, want, err = run_cli("gpus", [])
    assert rc == 0, err
    g = ditmem.gpus()
    assert g.to_dict() == want
    assert g["4090"].name == "rtx-4090"
    rc, one, err = run_cli("gpus", ["4090"])
    assert ditmem.gpus("4090").to_dict() == one


def test_spec_equals_cli():
    rc, want, err = run_cli("spec", flags({"model": "sana-600m", "batch": 2}))
    assert rc == 0, err
    assert ditmem.spec(model="sana-600m", batch=2) == want
