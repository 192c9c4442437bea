#!/usr/bin/env python3
"""PyTorch peer of a ditmem *family* spec: builds the real diffusers transformer class from
`model.diffusers` (its config.json), runs warm-up and measured training steps on cached inputs
as diffusers' training scripts run them, and prints one JSON object with the same keys as
`peer.py` (peak_bytes, resident_bytes, phase_peaks, step_time_s, params, conditions, ...).

    bench/torch_peer/.venv/bin/python bench/torch_peer/family_peer.py --spec S.json \
        [--warmup 1 --steps 1 --threads 2]

The step (see README "Family peer" for every tensor it creates, with shapes and dtypes):
  inputs drawn from a seeded generator (latents, noise, text embeddings, masks, ids, guidance) →
  noising (flow matching for sd3/flux/sana/wan, DDPM ε for dit/pixart) → transformer under
  torch.autocast(bf16) for bf16-mixed → loss in fp32 outside autocast → backward →
  optimizer.step() → EMA → zero_grad(set_to_none=True).

Exit status 2 with one line on stderr when the spec asks for something this peer does not run.
"""

import argparse
import json
import math
import os
import platform
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import record_function  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuda_snapshot  # noqa: E402
import measure  # noqa: E402
from peer import DTYPES, linear_schedule, percentiles  # noqa: E402
from spec import SpecUnsupported, parse_runtime, peer_main  # noqa: E402

# Transformer2DModel's remapping by norm_type (diffusers models/model_loading_utils.py).
REMAP = {"ada_norm_zero": "DiTTransformer2DModel", "ada_norm_single": "PixArtTransformer2DModel"}
FAMILY = {
    "DiTTransformer2DModel": "dit",
    "PixArtTransformer2DModel": "pixart",
    "SD3Transformer2DModel": "sd3",
    "FluxTransformer2DModel": "flux",
    "SanaTransformer2DModel": "sana",
    "WanTransformer3DModel": "wan",
}
# Defaults used when the spec leaves a field out (README "Family peer" lists them).
DEFAULT_VAE_FACTOR = {"dit": 8, "pixart": 8, "sd3": 8, "flux": 8, "sana": 32, "wan": 8}
FLUX_GUIDANCE = 3.5  # train_dreambooth_lora_flux.py --guidance_scale default
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8)  # the scripts' defaults
SGD_LR = 1e-4
DEFAULT_LORA_MODULES = ("to_q", "to_k", "to_v", "to_out.0")  # the diffusers LoRA scripts' default
# The scripts whose default differs, with --lora_layers unset (diffusers 58eb52c; the budget's
# `denoiser::SD3_LORA_MODULES` / `FLUX_LORA_MODULES`): train_dreambooth_lora_sd3.py adapts both
# streams' attention projections, train_dreambooth_lora_flux.py those and the feed-forwards.
SCRIPT_LORA_MODULES = {
    "sd3": ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
            "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"),
    "flux": ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
             "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
             "ff_context.net.0.proj", "ff_context.net.2"),
}
DIT_LORA_TARGETS = {"qkv", "proj", "fc1", "fc2", "adaln"}  # ditmem's LoraTarget (original DiT)


def class_name(cfg: dict) -> str:
    name = cfg["_class_name"]
    if name == "Transformer2DModel":
        name = REMAP.get(cfg.get("norm_type"), name)
    if name not in FAMILY:
        raise SpecUnsupported(f"model.diffusers._class_name '{cfg['_class_name']}' is not a family the peer runs")
    return name


def build_model(cfg: dict, device="cpu"):
    import diffusers

    cls = getattr(diffusers, class_name(cfg))
    kwargs = {k: v for k, v in cfg.items() if not k.startswith("_")}
    with torch.device(device):
        return cls.from_config(kwargs)


def keep_blocks(cfg: dict, family: str, keep: list) -> dict:
    """The config with fewer blocks (`model.keep_blocks`, `--depth N[,S]`), every other value kept,
    as the budget reads it (`crates/budget/src/families/model.rs` `Dims::with_depth`): one count
    for every kind of block or one per kind (Flux: double, single; SD3.5: dual-attention, joint,
    keeping the first N of each in their order). Without it the peer would build the whole model
    (SD3.5-medium: 2.2 G parameters) for a `--depth 1` spec."""
    if not keep:
        return cfg
    cfg = dict(cfg)
    count = lambda i: int(keep[0] if len(keep) == 1 else keep[i])  # noqa: E731
    if family == "flux":
        cfg["num_layers"], cfg["num_single_layers"] = count(0), count(1)
    elif family == "sd3" and cfg.get("dual_attention_layers"):
        dual_set = set(cfg["dual_attention_layers"])
        left, dual, kept = [count(0), count(1)], [], 0
        for i in range(int(cfg["num_layers"])):
            k = 0 if i in dual_set else 1
            if left[k] > 0:
                left[k] -= 1
                if k == 0:
                    dual.append(kept)
                kept += 1
        cfg["num_layers"], cfg["dual_attention_layers"] = kept, dual
    else:
        cfg["num_layers"] = count(0)
    return cfg


def default_text_tokens(family: str, cfg: dict) -> list:
    if family == "pixart":
        # α (PixArt-XL-2-*: 120 T5 tokens) unless the config is Σ's (its conversion script sets
        # use_additional_conditions false): 300.
        return [300] if cfg.get("use_additional_conditions") is False else [120]
    return {"sd3": [77, 77], "flux": [77, 512], "sana": [300], "wan": [512], "dit": []}[family]


class FamilySpec:
    """What the peer reads of a family spec; every default is named here."""

    def __init__(self, raw: dict):
        m, w = raw["model"], raw["workload"]
        r = raw.get("recipe", {}) or {}
        if "diffusers" not in m:
            raise SpecUnsupported("model.diffusers (the config.json) is missing: use peer.py for DiT specs")
        self.raw = raw
        self.cfg = dict(m["diffusers"])
        self.cls = class_name(self.cfg)
        self.family = FAMILY[self.cls]
        self.cfg = keep_blocks(self.cfg, self.family, m.get("keep_blocks") or [])
        if w.get("ranks", 1) != 1:
            raise SpecUnsupported("workload.ranks > 1: the peer runs one process")
        if r.get("zero_stage", 0):
            raise SpecUnsupported("recipe.zero_stage: the peer runs one process")
        if r.get("latents", "cached") != "cached":
            raise SpecUnsupported("recipe.latents = encode: the peer has no VAE (use cached)")
        self.height, self.width = int(w["height"]), int(w["width"])
        self.microbatch = int(w.get("microbatch", w.get("batch", 1)))
        self.accumulation = int(w.get("accumulation", 1))
        self.frames = int(w.get("frames", 1))
        self.vae_factor = int(w.get("vae_factor", DEFAULT_VAE_FACTOR[self.family]))
        tt = w.get("text_tokens")
        self.text_tokens = list(tt) if tt else default_text_tokens(self.family, self.cfg)
        self.precision = r.get("precision", "bf16-mixed")
        if self.precision not in ("fp32", "bf16-mixed"):
            raise SpecUnsupported(f"precision '{self.precision}' (the family peer runs fp32, bf16-mixed)")
        self.optimizer = r.get("optimizer", "adamw")
        if self.optimizer not in ("adamw", "sgd"):
            raise SpecUnsupported(f"optimizer '{self.optimizer}' (the peer runs adamw, sgd)")
        self.optimizer_impl = r.get("optimizer_impl") or "for-loop"  # torch's CPU default
        if self.optimizer_impl not in ("for-loop", "foreach"):
            raise SpecUnsupported(f"optimizer_impl '{self.optimizer_impl}' (for-loop, foreach)")
        self.recompute = r.get("recompute", "none")
        if self.recompute not in ("none", "all"):
            raise SpecUnsupported(f"recompute '{self.recompute}': diffusers checkpoints every block or none (none, all)")
        lora = r.get("lora")
        self.lora = None
        if lora:
            # ditmem's LoraSpec: `modules` = PEFT target_modules names (empty: the family's
            # script default, SCRIPT_LORA_MODULES or DEFAULT_LORA_MODULES); `targets` holds the original DiT's linears (qkv, proj,
            # fc1, fc2, adaln) and is ignored here unless it holds module names.
            mods = list(lora.get("modules") or [])
            if not mods:
                mods = [t for t in (lora.get("targets") or []) if t not in DIT_LORA_TARGETS]
            self.lora = {"rank": int(lora["rank"]), "targets": mods or list(SCRIPT_LORA_MODULES.get(self.family, DEFAULT_LORA_MODULES))}
            self.lora["alpha"] = int(lora.get("alpha", self.lora["rank"]))
            # ditmem's LoraDtype: "fp32" (cast_training_params to fp32) or "weight" (the
            # adapters stay in weight_dtype, as the diffusers LoRA scripts keep them under bf16).
            self.lora["dtype"] = lora.get("dtype", "fp32")
            if self.lora["dtype"] not in ("fp32", "weight"):
                raise SpecUnsupported(f"lora.dtype '{self.lora['dtype']}' (fp32, weight)")
        ema = r.get("ema") or {}  # ditmem's EmaSpec default: enabled, f32, 0.9999
        self.ema = bool(ema.get("enabled", True))
        self.ema_dtype = ema.get("dtype", "f32")
        self.ema_decay = float(ema.get("decay", 0.9999))
        self.device, _ = parse_runtime(raw.get("runtime", "pytorch:cpu"))
        self._latent_shape()

    def _latent_shape(self):
        c, f = self.cfg, self.vae_factor
        if self.height % f or self.width % f:
            raise SpecUnsupported(f"resolution not divisible by vae_factor {f}")
        h, w = self.height // f, self.width // f
        fam = self.family
        if fam == "flux":
            ch = c.get("in_channels", 64) // 4  # 2×2-packed latent
            if h % 2 or w % 2:
                raise SpecUnsupported("flux: the latent must be divisible by 2 (2×2 packing)")
        elif fam == "wan":
            ch = c.get("in_channels", 16)
        else:
            ch = c.get("in_channels", 4 if fam in ("dit", "pixart") else (16 if fam == "sd3" else 32))
        lc = self.raw["workload"].get("latent_channels")
        if lc is not None and int(lc) != ch:
            raise SpecUnsupported(f"workload.latent_channels {lc} ≠ the config's latent channels {ch}")
        self.latent_channels = ch
        if fam == "wan":
            tf = int(self.raw["workload"].get("vae_temporal_factor", 4))  # Wan's VAE: 4
            if tf != 4:
                raise SpecUnsupported(f"wan: workload.vae_temporal_factor {tf} (Wan 2.1's VAE compresses time by 4)")
            if (self.frames - 1) % tf:
                raise SpecUnsupported("wan: frames must be 4k + 1")
            self.latent_frames = (self.frames - 1) // tf + 1
            self.latent = (self.microbatch, ch, self.latent_frames, h, w)
        else:
            if self.frames != 1:
                raise SpecUnsupported(f"{fam}: frames must be 1 (an image model)")
            self.latent_frames = 1
            self.latent = (self.microbatch, ch, h, w)
        patch = c.get("patch_size", 2 if fam in ("dit", "pixart", "sd3") else 1)
        if fam == "wan":
            pt, ph, pw = patch if isinstance(patch, (list, tuple)) else (1, 2, 2)
            self.image_tokens = (self.latent_frames // pt) * (h // ph) * (w // pw)
        elif fam == "flux":
            self.image_tokens = (h // 2) * (w // 2)
        else:
            self.image_tokens = (h // patch) * (w // patch)

    @property
    def autocast(self):
        return torch.bfloat16 if self.precision == "bf16-mixed" else None

    @property
    def weight_dtype(self):
        """The scripts' weight_dtype: the cached latents, text embeddings and (LoRA) frozen base
        weights are in it."""
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float32


def load_spec(path: str) -> FamilySpec:
    with open(path, encoding="utf-8") as f:
        return FamilySpec(json.load(f))


def prepare_model(fs: FamilySpec, device):
    """Model as the scripts set it up: fp32 from_config; LoRA: base frozen and cast to
    weight_dtype, gradient checkpointing, add_adapter, trainable (LoRA) params cast to fp32
    (lora.dtype "fp32") or left in weight_dtype ("weight")."""
    model = build_model(fs.cfg)
    model.to(device=device, dtype=torch.float32).train()
    if fs.lora:
        from peft import LoraConfig
        from diffusers.training_utils import cast_training_params

        model.requires_grad_(False)
        model.to(dtype=fs.weight_dtype)
    if fs.recompute == "all":
        model.enable_gradient_checkpointing()
    if fs.lora:
        config = LoraConfig(
            r=fs.lora["rank"],
            lora_alpha=fs.lora["alpha"],
            init_lora_weights="gaussian",
            target_modules=fs.lora["targets"],
        )
        if hasattr(model, "add_adapter"):
            model.add_adapter(config)
        else:
            # DiTTransformer2DModel and PixArtTransformer2DModel have no PeftAdapterMixin: what
            # add_adapter does, peft's inject_adapter_in_model (adapter "default", active).
            from peft import inject_adapter_in_model

            inject_adapter_in_model(config, model, "default")
        model._lora_dtypes_before_cast = sorted(
            {str(p.dtype).replace("torch.", "") for p in model.parameters() if p.requires_grad}
        )
        # The scripts: `if args.mixed_precision == "fp16": cast_training_params(...)`; ditmem's
        # lora.dtype says which (PEFT has already put the adapters in the base's dtype).
        if fs.lora["dtype"] == "fp32":
            cast_training_params(model, dtype=torch.float32)
    return model


class Inputs:
    """Draws the step's cached inputs from a seeded generator and builds the transformer's
    keyword arguments and the loss target, per family. Every tensor made here is listed in the
    README ("Family peer")."""

    def __init__(self, fs: FamilySpec, model, device, seed: int):
        self.fs = fs
        self.device = device
        self.gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        self.cfg = model.config
        if fs.family in ("dit", "pixart"):
            self.acp = linear_schedule().to(dtype=torch.float32)  # DDPMScheduler "linear"

    def randn(self, *shape, dtype=None):
        return torch.randn(*shape, generator=self.gen, dtype=dtype or self.fs.weight_dtype).to(self.device)

    def forward(self, model):
        """Returns (model_pred, target): the prediction as the transformer returns it (plus the
        scripts' reshapes), and the target."""
        fs, cfg, b = self.fs, self.cfg, self.fs.microbatch
        wd = fs.weight_dtype
        x0 = self.randn(*fs.latent)
        noise = self.randn(*fs.latent)
        fam = fs.family
        if fam in ("dit", "pixart"):
            t = torch.randint(0, 1000, (b,), generator=self.gen).to(self.device)
            # DDPMScheduler.add_noise: alphas_cumprod cast to the sample's dtype.
            acp = self.acp.to(device=self.device, dtype=x0.dtype)
            sa = (acp[t] ** 0.5).flatten().view(b, 1, 1, 1)
            so = ((1 - acp[t]) ** 0.5).flatten().view(b, 1, 1, 1)
            noisy = sa * x0 + so * noise
            del sa, so, acp
            kw = {}
            if fam == "dit":
                y = torch.randint(0, cfg.num_embeds_ada_norm, (b,), generator=self.gen).to(self.device)
                ctx = self._autocast()
                with ctx:
                    pred = model(noisy, timestep=t, class_labels=y, return_dict=False)[0]
            else:
                (nt,) = fs.text_tokens
                enc = self.randn(b, nt, cfg.caption_channels or cfg.cross_attention_dim)
                mask = self.mask(b, nt)
                if model.use_additional_conditions:
                    res = torch.tensor([[fs.height, fs.width]], dtype=wd).repeat(b, 1)
                    ar = torch.tensor([[fs.height / fs.width]], dtype=wd).repeat(b, 1)
                    kw["added_cond_kwargs"] = {"resolution": res, "aspect_ratio": ar}
                else:
                    kw["added_cond_kwargs"] = {"resolution": None, "aspect_ratio": None}
                with self._autocast():
                    pred = model(noisy, encoder_hidden_states=enc, encoder_attention_mask=mask,
                                 timestep=t, return_dict=False, **kw)[0]
                del enc, mask
            del noisy, x0
            c = fs.latent_channels
            if pred.shape[1] == 2 * c:  # learned sigma: the loss is on the ε channels (a view)
                pred = pred[:, :c]
            return pred, noise
        # Flow matching (rectified flow): σ uniform, no weighting.
        u = torch.rand(b, generator=self.gen).to(self.device)  # fp32
        timesteps = u * 1000.0
        sigmas = u.to(dtype=wd).view(b, *([1] * (x0.ndim - 1)))
        noisy = (1.0 - sigmas) * x0 + sigmas * noise
        if fam == "sd3":
            clip, t5 = fs.text_tokens
            enc = self.randn(b, clip + t5, cfg.joint_attention_dim)
            pooled = self.randn(b, cfg.pooled_projection_dim)
            with self._autocast():
                pred = model(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=enc,
                             pooled_projections=pooled, return_dict=False)[0]
            del enc, pooled
        elif fam == "flux":
            _clip, t5 = fs.text_tokens
            _, c, h, w = x0.shape
            enc = self.randn(b, t5, cfg.joint_attention_dim)
            pooled = self.randn(b, cfg.pooled_projection_dim)
            txt_ids = torch.zeros(t5, 3).to(device=self.device, dtype=wd)
            img_ids = flux_image_ids(h // 2, w // 2).to(device=self.device, dtype=wd)
            guidance = None
            if cfg.guidance_embeds:
                guidance = torch.tensor([FLUX_GUIDANCE], device=self.device).expand(b)
            packed = flux_pack(noisy, b, c, h, w)
            with self._autocast():
                pred = model(hidden_states=packed, timestep=timesteps / 1000, guidance=guidance,
                             pooled_projections=pooled, encoder_hidden_states=enc,
                             txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
            del packed, enc, pooled, txt_ids, img_ids, guidance
            pred = flux_unpack(pred, h, w)
        elif fam == "sana":
            (nt,) = fs.text_tokens
            enc = self.randn(b, nt, cfg.caption_channels)
            mask = self.mask(b, nt)
            with self._autocast():
                pred = model(hidden_states=noisy, encoder_hidden_states=enc, encoder_attention_mask=mask,
                             timestep=timesteps, return_dict=False)[0]
            del enc, mask
        else:  # wan
            (nt,) = fs.text_tokens
            enc = self.randn(b, nt, cfg.text_dim)
            with self._autocast():
                pred = model(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=enc,
                             return_dict=False)[0]
            del enc
        del noisy
        target = noise - x0
        return pred, target

    def mask(self, b, n):
        """The tokenizer's attention mask of a padded prompt: int64 (b, n), the first
        ceil(n/2) tokens 1, the rest padding 0."""
        m = torch.zeros(b, n, dtype=torch.int64)
        m[:, : math.ceil(n / 2)] = 1
        return m.to(self.device)

    def _autocast(self):
        ac = self.fs.autocast
        return torch.autocast(self.device.type, dtype=ac, enabled=ac is not None)


def flux_image_ids(h2: int, w2: int) -> torch.Tensor:
    """FluxPipeline._prepare_latent_image_ids (written out: the pipeline module imports
    transformers)."""
    ids = torch.zeros(h2, w2, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(h2)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(w2)[None, :]
    return ids.reshape(h2 * w2, 3)


def flux_pack(latents, b, c, h, w):
    """FluxPipeline._pack_latents: (b, c, h, w) → (b, h/2·w/2, 4c); the reshape copies."""
    latents = latents.view(b, c, h // 2, 2, w // 2, 2)
    latents = latents.permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def flux_unpack(latents, h, w):
    """FluxPipeline._unpack_latents back to (b, c, h, w) (h, w: latent size); the reshape
    copies."""
    b, _n, ch = latents.shape
    latents = latents.view(b, h // 2, w // 2, ch // 4, 2, 2)
    latents = latents.permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, ch // 4, h, w)


def loss_of(fs: FamilySpec, pred, target):
    """fp32 loss outside autocast. Flow families: the scripts' per-sample mean of
    (pred.float() − target.float())², then the batch mean (weighting 'none' omitted); DDPM
    families: train_text_to_image.py's F.mse_loss(pred.float(), target.float())."""
    if fs.family in ("dit", "pixart"):
        return F.mse_loss(pred.float(), target.float(), reduction="mean")
    b = target.shape[0]
    return torch.mean(((pred.float() - target.float()) ** 2).reshape(b, -1), 1).mean()


class FamilyTrainer:
    def __init__(self, fs: FamilySpec, device, seed: int):
        torch.manual_seed(seed)
        self.fs = fs
        self.device = device
        self.model = self.prepare(fs, device)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = self.optimizer()
        self.ema = []
        if fs.ema:
            dt = DTYPES[fs.ema_dtype]
            self.ema = [p.detach().to(dtype=dt, copy=True) for p in self.trainable]
        self.inputs = Inputs(fs, self.model, device, seed)
        self.losses = []

    def prepare(self, fs: FamilySpec, device):
        """The model to train on `device`."""
        return prepare_model(fs, device)

    def optimizer(self):
        """The optimizer of the trainable parameters."""
        foreach = self.fs.optimizer_impl == "foreach"
        if self.fs.optimizer == "adamw":
            return torch.optim.AdamW(self.trainable, foreach=foreach, **ADAMW)
        return torch.optim.SGD(self.trainable, lr=SGD_LR, foreach=foreach)

    def microbatch(self):
        with record_function("ditmem::forward"):
            pred, target = self.inputs.forward(self.model)
            loss = loss_of(self.fs, pred, target) / self.fs.accumulation
            del pred, target
        with record_function("ditmem::backward"):
            loss.backward()
        return loss.detach().item()

    def step(self):
        total = 0.0
        for _ in range(self.fs.accumulation):
            total += self.microbatch()
        self.losses.append(total)
        with record_function("ditmem::optimizer"):
            self.opt.step()
            if self.ema:
                with torch.no_grad():
                    d = self.fs.ema_decay
                    src = [p.detach().to(e.dtype) for p, e in zip(self.trainable, self.ema)]
                    torch._foreach_mul_(self.ema, d)
                    torch._foreach_add_(self.ema, src, alpha=1 - d)
                    del src
            self.opt.zero_grad(set_to_none=True)


def param_counts(model) -> dict:
    return {
        "reported": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "trainable_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.requires_grad}),
        "frozen_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if not p.requires_grad}),
        "lora_dtypes_before_cast": getattr(model, "_lora_dtypes_before_cast", None),
    }


def versions() -> dict:
    import diffusers

    out = {"torch": torch.__version__, "diffusers": diffusers.__version__}
    try:
        import peft

        out["peft"] = peft.__version__
    except ImportError:
        out["peft"] = None
    return out


def run(args) -> dict:
    fs = load_spec(args.spec)
    device = torch.device(fs.device)
    cuda_snapshot.check(args.snapshot, device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecUnsupported("device cuda requested but torch.cuda.is_available() is False")
    if device.type == "cuda" and not args.snapshot:
        raise SpecUnsupported("the family peer measures CUDA only with --snapshot (runtime pytorch:cpu otherwise)")
    if args.threads:
        torch.set_num_threads(args.threads)
    tr = FamilyTrainer(fs, device, args.seed)
    counts = param_counts(tr.model)
    cuda_snapshot.start(args.snapshot, args.snapshot_max_entries)
    for _ in range(args.warmup):
        tr.step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        tr.step()
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        # The measured step under the allocator's counters, then the snapshot.
        c = measure.cuda_step_peak(tr.step, device)
        cuda_snapshot.dump(args.snapshot, device)
        return {
            "peak_bytes": c["max_allocated"],
            "peak_reserved_bytes": c["max_reserved"],
            "cuda": c,
            "snapshot": args.snapshot,
            "method": "torch.cuda.max_memory_allocated / max_memory_reserved after reset_peak_memory_stats",
            "params": counts,
            "step_time_s": percentiles(times),
            "losses": tr.losses,
            "conditions": {**versions(), "device": "cuda", "device_name": torch.cuda.get_device_name(device),
                           "warmup": args.warmup, "steps": args.steps, "seed": args.seed},
        }
    tr.opt.zero_grad(set_to_none=True)
    # Resident: parameters, buffers, optimizer state, EMA, and the DDPM families' alphas_cumprod
    # (the scheduler's (1000,) fp32 table, alive across steps).
    extra = [tr.inputs.acp] if hasattr(tr.inputs, "acp") else []
    resident = measure.tensor_bytes(measure.resident_tensors(tr.model, tr.opt, tr.ema) + extra)
    above, net, phases = measure.cpu_step_peak(tr.step)
    v = versions()
    return {
        "peak_bytes": resident + above,
        "resident_bytes": resident,
        "phase_peaks": {k: resident + p for k, p in phases.items()},
        "step_peak_above_resident": above,
        "step_net_bytes": net,
        "method": "torch.profiler profile_memory: max running sum of [memory] events over one step",
        "params": counts,
        "step_time_s": percentiles(times),
        "losses": tr.losses,
        "conditions": {
            **v,
            "python": platform.python_version(),
            "device": "cpu",
            "device_name": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "family": fs.family,
            "class": fs.cls,
            "precision": fs.precision,
            "autocast": "bfloat16" if fs.autocast else None,
            "weight_dtype": str(fs.weight_dtype).replace("torch.", ""),
            "attention": "diffusers default processor (F.scaled_dot_product_attention)",
            "gradient_checkpointing": fs.recompute == "all",
            "optimizer": fs.optimizer,
            "optimizer_impl": fs.optimizer_impl,
            "lora": fs.lora,
            "ema": fs.ema,
            "microbatch": fs.microbatch,
            "accumulation": fs.accumulation,
            "latent": list(fs.latent),
            "image_tokens": fs.image_tokens,
            "text_tokens": fs.text_tokens,
            "frames": fs.frames,
            "vae_factor": fs.vae_factor,
            "warmup": args.warmup,
            "steps": args.steps,
            "seed": args.seed,
        },
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True, help="family spec JSON (model.diffusers present)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (0: PyTorch's default)")
    ap.add_argument("--seed", type=int, default=0)
    cuda_snapshot.add_arguments(ap)
    return peer_main("family_peer", ap.parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
