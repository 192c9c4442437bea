"""Bad input raises InvalidInput (a ValueError) with the CLI's one line; an infeasible plan
raises DoesNotFit with the smallest reachable peak."""

from __future__ import annotations

import pytest

import ditmem
from conftest import flags, run_cli


@pytest.mark.parametrize(
    "kw",
    [
        {"model": "dit-s-2", "batch": 0},
        {"model": "dit-s-2", "precision": "fp8"},
        {"model": "dit-s-2", "gpu": "rtx-9999"},
        {"model": "flux.1-dev", "optimizer": "sgdx"},
        {"model": "dit-s-2", "recompute": "sometimes"},
    ],
)
def test_bad_values_carry_the_cli_message(kw):
    rc, _, err = run_cli("estimate", flags(kw))
    assert rc == 2
    with pytest.raises(ditmem.InvalidInput) as e:
        ditmem.estimate(**kw)
    assert isinstance(e.value, ValueError)
    assert e.value.exit_code == 2
    assert str(e.value) == err.removeprefix("ditmem: ")


def test_unknown_argument_lists_the_allowed():
    with pytest.raises(ValueError) as e:
        ditmem.estimate(model="dit-s-2", lora_rnk=4)
    assert "lora_rnk" in str(e.value) and "lora_rank" in str(e.value)
    assert "lora_rank" in ditmem.argument_names("estimate")


def test_unknown_preset_and_unusable_values():
    with pytest.raises(ditmem.InvalidInput):
        ditmem.estimate(model="no-such-model")
    with pytest.raises(ditmem.InvalidInput) as e:
        ditmem.estimate(model="dit-s-2", batch=object())
    assert "batch" in str(e.value)
    with pytest.raises(ditmem.InvalidInput):
        ditmem.argument_names("launch")


def test_infeasible_plan_is_does_not_fit():
    kw = {"model": "flux.1-dev", "budget": "4GiB"}
    rc, want, err = run_cli("plan", flags(kw))
    assert rc == 3
    with pytest.raises(ditmem.DoesNotFit) as e:
        ditmem.plan(**kw)
    assert e.value.exit_code == 3
    assert e.value.smallest_peak_bytes == want["predicted_peak_bytes"] > 4 << 30
    assert str(e.value) == err.removeprefix("ditmem: ")
    assert e.value.plan is not None and not e.value.plan.feasible
    assert "infeasible" in repr(e.value.plan) or "nothing fits" in repr(e.value.plan)


def test_oom_message():
    msg = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB "
           "of which 1.20 GiB is free. Of the allocated memory 20.30 GiB is allocated by PyTorch, "
           "and 1.60 GiB is reserved by PyTorch but unallocated.")
    rc, want, err = run_cli("oom", flags({"model": "flux.1-dev", "lora_rank": 16}) + ["--", msg])
    assert rc == 0, err
    # keyword order must not matter: "message" sorts before "model"
    r = ditmem.oom(msg, model="flux.1-dev", lora_rank=16)
    assert r.to_dict() == want
    assert r.cause == want["diagnosis"]["cause"]
    assert repr(r).startswith("CUDA out of memory: tried to allocate 2.00 GiB")
    with pytest.raises(ditmem.InvalidInput):
        ditmem.oom("nothing like an OOM message", model="flux.1-dev")
