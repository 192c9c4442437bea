"""Every diffusers preset built as its real diffusers class on the meta device and handed to
ditmem.params(model=...) as a live model: the package reads its .config and holds its own
sum(p.numel()) against ditmem's count (a mismatch raises ditmem.ModelMismatch).

    PYTHONPATH=$PWD/python bench/torch_peer/.venv/bin/python bench/torch_peer/python_live_models.py
"""
import time, torch, diffusers, ditmem
ok = []
for name in ditmem.presets():
    if name.startswith("dit-") and not name.startswith("dit-xl-2-"):
        continue
    cfg = ditmem.spec(model=name)["model"]["diffusers"]
    cls = getattr(diffusers, cfg["_class_name"], None)
    if cls is None:
        print(name, "no class", cfg["_class_name"]); continue
    with torch.device("meta"):
        m = cls.from_config({k: v for k, v in cfg.items() if not k.startswith("_")})
    try:
        p = ditmem.params(model=m)
        print(f"{name:<20} {type(m).__name__:<28} own {sum(x.numel() for x in m.parameters()):>15,}  ditmem {p.total:>15,}  ok")
    except ditmem.DitmemError as e:
        print(f"{name:<20} {type(m).__name__:<28} ERROR {e}")
