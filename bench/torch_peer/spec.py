"""Reading a ditmem spec (the JSON that `ditmem spec --json` prints) into what the peer runs."""

import json
import sys
from dataclasses import dataclass, field


class SpecUnsupported(ValueError):
    """The spec asks for something the peer does not implement."""


def peer_main(prog: str, args, run) -> int:
    """The peers' ending: refuse `--warmup` < 1, run, print the result as JSON (exit 0), or say
    why the spec cannot run (exit 2)."""
    if args.warmup < 1:
        print(f"{prog}: --warmup must be ≥ 1 (optimizer state is created by the first step)", file=sys.stderr)
        return 2
    try:
        result = run(args)
    except (SpecUnsupported, KeyError, OSError, json.JSONDecodeError) as e:
        print(f"{prog}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


@dataclass
class PeerSpec:
    model: dict
    latent_h: int
    latent_w: int
    microbatch: int
    accumulation: int
    precision: str
    optimizer: str
    fused_attention: bool
    checkpoint_blocks: list = field(default_factory=list)
    ema: bool = False
    ema_dtype: str = "f32"
    ema_decay: float = 0.9999
    prediction: str = "eps"
    device: str = "cpu"
    sdpa_backend: str = "auto"
    # torch.optim implementation: "for-loop", "foreach", "fused"; None = PyTorch's default for the
    # device (for-loop on the CPU, foreach on CUDA).
    optimizer_impl: str | None = None
    raw: dict = field(default_factory=dict)


def recompute_blocks(policy: str, depth: int) -> list:
    """Blocks wrapped in torch.utils.checkpoint, from the spec's recompute string."""
    if policy == "none":
        return []
    if policy == "all":
        return list(range(depth))
    if policy.startswith("every-"):
        k = int(policy[len("every-") :])
        if k < 1:
            raise SpecUnsupported(f"recompute '{policy}': K must be ≥ 1")
        return [i for i in range(depth) if i % k == 0]
    if policy.startswith("blocks:"):
        items = [s.strip() for s in policy[len("blocks:") :].split(",") if s.strip()]
        return sorted({int(s) for s in items if int(s) < depth})
    raise SpecUnsupported(f"recompute '{policy}' is not supported by the PyTorch peer (none, all, every-K, blocks:…)")


def parse_runtime(rt: str) -> tuple:
    """`pytorch[:cpu|:cuda][:sdpa-…]` → (device, sdpa backend). Other runtimes run on the CPU."""
    parts = rt.split(":")
    device, backend = "cpu", "auto"
    if parts[0] == "pytorch":
        for p in parts[1:]:
            if p in ("cpu", "cuda"):
                device = p
            elif p.startswith("sdpa-"):
                backend = p[len("sdpa-") :]
            else:
                raise SpecUnsupported(f"runtime option '{p}' is unknown")
    return device, backend


def load(path: str) -> PeerSpec:
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    return from_dict(raw)


def from_dict(raw: dict) -> PeerSpec:
    m, w = raw["model"], raw["workload"]
    r = raw.get("recipe", {})
    if w.get("ranks", 1) != 1:
        raise SpecUnsupported("workload.ranks > 1: the peer runs one process")
    if r.get("lora"):
        raise SpecUnsupported("recipe.lora: the peer trains the full model only")
    if r.get("zero_stage", 0):
        raise SpecUnsupported("recipe.zero_stage: the peer runs one process")
    if r.get("latents", "cached") != "cached":
        raise SpecUnsupported("recipe.latents = encode: the peer has no VAE (use cached)")
    if m.get("attn_dropout", 0) or m.get("mlp_dropout", 0):
        raise SpecUnsupported("dropout inside blocks is not implemented by the peer")
    precision = r.get("precision", "bf16-mixed")
    if precision not in ("fp64", "fp32", "bf16-mixed", "fp16-mixed"):
        raise SpecUnsupported(f"precision '{precision}' (the peer runs fp64, fp32, bf16-mixed, fp16-mixed)")
    optimizer = r.get("optimizer", "adamw")
    if optimizer not in ("adamw", "sgd"):
        raise SpecUnsupported(f"optimizer '{optimizer}' (the peer runs adamw, sgd)")
    optimizer_impl = r.get("optimizer_impl")
    if optimizer_impl not in (None, "for-loop", "foreach", "fused"):
        raise SpecUnsupported(f"optimizer_impl '{optimizer_impl}' (for-loop, foreach, fused)")
    policy = r.get("recompute", "none")
    if policy == "attention-only":
        raise SpecUnsupported("recompute 'attention-only' is not implemented by the peer")
    factor = w.get("vae_factor", 8)
    if w["height"] % (factor * m["patch"]) or w["width"] % (factor * m["patch"]):
        raise SpecUnsupported("resolution not divisible by vae_factor × patch")
    ema = r.get("ema", {"enabled": True})
    device, backend = parse_runtime(raw.get("runtime", "ditmem-cpu"))
    return PeerSpec(
        model=m,
        latent_h=w["height"] // factor,
        latent_w=w["width"] // factor,
        microbatch=w["microbatch"],
        accumulation=w.get("accumulation", 1),
        precision=precision,
        optimizer=optimizer,
        fused_attention=r.get("attention", "materialized") == "memory-efficient",
        checkpoint_blocks=recompute_blocks(policy, m["depth"]),
        ema=bool(ema.get("enabled", True)),
        ema_dtype=ema.get("dtype", "f32"),
        ema_decay=float(ema.get("decay", 0.9999)),
        prediction=r.get("prediction", "eps"),
        device=device,
        sdpa_backend=backend,
        optimizer_impl=optimizer_impl,
        raw=raw,
    )
