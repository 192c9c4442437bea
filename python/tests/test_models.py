"""model= as a config dict, a config.json path or folder, and a live diffusers-style model
(`.config` a FrozenDict-like mapping, `.parameters()` objects with `numel()`)."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest

import ditmem


class FrozenDict(OrderedDict):
    """diffusers.configuration_utils.FrozenDict: an OrderedDict that refuses changes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.__frozen = True

    def __setitem__(self, key, value):
        if getattr(self, "_FrozenDict__frozen", False):
            raise Exception(f"You cannot use ``__setitem__`` on a {self.__class__.__name__} instance.")
        super().__setitem__(key, value)


class Param:
    def __init__(self, n):
        self.n = n

    def numel(self):
        return self.n


class PixArtTransformer2DModel:
    """A stand-in of a diffusers model: config as ModelMixin keeps it (no _class_name, the
    bookkeeping keys diffusers adds) and parameters whose counts sum to `total`."""

    def __init__(self, config, total):
        cfg = {k: v for k, v in config.items() if k != "_class_name"}
        cfg["_use_default_values"] = ["use_additional_conditions"]
        cfg["_diffusers_version"] = "0.32.0"
        cfg["_name_or_path"] = "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"
        self.config = FrozenDict(cfg)
        self._params = [Param(total // 2), Param(total - total // 2)]
        self.calls = 0

    def parameters(self):
        self.calls += 1
        return iter(self._params)


@pytest.fixture(scope="module")
def pixart_config():
    return ditmem.spec(model="pixart-sigma-1024")["model"]["diffusers"]


def test_config_dict_is_the_preset(pixart_config):
    by_dict = ditmem.estimate(model=pixart_config, gpu="a100-80gb")
    by_name = ditmem.estimate(model="pixart-sigma-1024", gpu="a100-80gb")
    assert by_dict.need_bytes == by_name.need_bytes
    assert by_dict.params["total"] == by_name.params["total"]


def test_config_path_and_folder(tmp_path, pixart_config):
    (tmp_path / "config.json").write_text(json.dumps(pixart_config))
    want = ditmem.params(model="pixart-sigma-1024").total
    assert ditmem.params(model=str(tmp_path / "config.json")).total == want
    assert ditmem.params(model=tmp_path).total == want  # a PathLike folder


def test_live_model_is_read_and_checked(pixart_config):
    total = ditmem.params(model="pixart-sigma-1024").total
    model = PixArtTransformer2DModel(pixart_config, total)
    e = ditmem.estimate(model=model, gpu="rtx-4090", lora_rank=16)
    assert model.calls == 1
    want = ditmem.estimate(model="pixart-sigma-1024", gpu="rtx-4090", lora_rank=16)
    assert e.need_bytes == want.need_bytes
    assert e.peak_bytes == want.peak_bytes
    p = ditmem.plan(model=model, gpu="rtx-4090")
    assert p.feasible
    # Its `_name_or_path` names the checkpoint (PixArt-Σ: 300 T5 tokens); without it, a
    # config is read as PixArt-α's 120 (crates/budget/src/families/model.rs).
    assert e.spec["model"]["name"] == "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"
    del model.config["_name_or_path"]
    alpha = ditmem.estimate(model=model, gpu="rtx-4090", lora_rank=16)
    assert alpha.need_bytes < e.need_bytes


def test_live_model_mismatch_names_both_counts(pixart_config):
    total = ditmem.params(model="pixart-sigma-1024").total
    model = PixArtTransformer2DModel(pixart_config, total + 4096)
    with pytest.raises(ditmem.ModelMismatch) as e:
        ditmem.estimate(model=model)
    msg = str(e.value)
    assert f"{total + 4096:,}" in msg and f"{total:,}" in msg
    assert isinstance(e.value, ValueError)
    assert (e.value.model_count, e.value.ditmem_count) == (total + 4096, total)


def test_real_torch_module_where_installed():
    torch = pytest.importorskip("torch")
    m = torch.nn.Linear(4, 4)
    m.config = {"_class_name": "Nope"}
    with pytest.raises(ditmem.InvalidInput):
        ditmem.params(model=m)
