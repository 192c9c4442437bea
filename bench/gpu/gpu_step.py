#!/usr/bin/env python3
"""One row of the GPU kit: real training steps of a ditmem family spec on the real diffusers
class, on CUDA (or on the CPU for `run.sh --cpu`), measured as the kit records it. Prints one
JSON object.

    python bench/gpu/gpu_step.py --spec S.json [--device cuda|cpu] [--steps 3] [--snapshot F.pickle]

The step is family_peer.py's (bench/torch_peer: the same inputs, noising, loss, optimizer, EMA and
zero_grad; LoRA through PEFT with the base frozen in the weight dtype), with what a CUDA run adds:
  * the model is built on the device (`with torch.device("cuda")`: no CPU init of a 2B model);
  * `recipe.precision` bf16-pure: the whole model in bf16, no autocast, the optimizer on bf16;
  * `recipe.optimizer_impl` fused: `torch.optim.AdamW(fused=True)`;
  * `recipe.optimizer` adamw-8bit: `bitsandbytes.optim.AdamW8bit` (paged: `PagedAdamW8bit`);
  * `recipe.base_quant` nf4: every `nn.Linear` of the blocks' ModuleLists replaced by
    `bitsandbytes.nn.Linear4bit` (NF4, double quantization, compute dtype bf16) before PEFT's
    adapters are added (QLoRA as train_dreambooth_lora_flux.py's `--bnb_quantization_config_path`
    loads it).
Measured (CUDA): `mem_get_info` before the model and after the steps, `reset_peak_memory_stats`
before the measured step (after warm-up and timed steps) and `max_memory_allocated` /
`max_memory_reserved` after it, the process's figure in `nvidia-smi --query-compute-apps`, the
step time p50 of the timed steps, and optionally a memory snapshot (`_record_memory_history` from
the first warm-up step, `_dump_snapshot` after the measured step). CPU: the profiler's peak as
family_peer.py measures it (PyTorch has no CPU allocator statistics).
Exit status 2 and one line on stderr for what it cannot run (e.g. bitsandbytes absent).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(os.path.dirname(HERE), "torch_peer")
sys.path.insert(0, PEER)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch  # noqa: E402

import family_peer as fp  # noqa: E402
import measure  # noqa: E402
from spec import SpecUnsupported  # noqa: E402

BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks")


class GpuSpec(fp.FamilySpec):
    """family_peer's spec with what a CUDA run adds (bf16-pure, fused, 8-bit AdamW, NF4 base)."""

    def __init__(self, raw: dict, device: str):
        raw = json.loads(json.dumps(raw))
        r = raw.setdefault("recipe", {})
        self.pure = r.get("precision") == "bf16-pure"
        self.fused = r.get("optimizer_impl") == "fused"
        self.adam8 = r.get("optimizer") == "adamw-8bit"
        self.paged = bool(r.get("paged_optimizer", False))
        self.nf4 = r.get("base_quant", "none") == "nf4"
        if r.get("base_quant", "none") not in ("none", "nf4"):
            raise SpecUnsupported(f"base_quant {r['base_quant']} (the kit runs none, nf4)")
        if device == "cpu" and (self.fused or self.adam8 or self.nf4):
            raise SpecUnsupported("fused AdamW, 8-bit AdamW and NF4 run on CUDA only")
        if self.pure:
            r["precision"] = "fp32"
        if self.fused:
            r["optimizer_impl"] = "foreach"
        if self.adam8:
            r["optimizer"] = "adamw"
        raw["runtime"] = "pytorch:cpu"  # family_peer's reader; the device is ours
        super().__init__(raw)
        if self.pure:
            self.precision = "bf16-pure"

    @property
    def autocast(self):
        return torch.bfloat16 if self.precision == "bf16-mixed" else None

    @property
    def weight_dtype(self):
        return torch.bfloat16 if self.precision in ("bf16-mixed", "bf16-pure") else torch.float32


def quantize_blocks_nf4(model, device):
    import bitsandbytes as bnb

    for lname in BLOCK_LISTS:
        blocks = getattr(model, lname, None)
        if blocks is None:
            continue
        for parent in blocks.modules():
            for cname, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.bfloat16, compress_statistics=True,
                                          quant_type="nf4")
                    q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False,
                                                 quant_type="nf4", compress_statistics=True)
                    if child.bias is not None:
                        q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                    setattr(parent, cname, q.to(device))
    return model


def prepare(fs: GpuSpec, device):
    """family_peer.prepare_model, built on the device, with bf16-pure and the NF4 base."""
    with torch.device(device):
        model = fp.build_model(fs.cfg)
    model.to(device=device, dtype=torch.float32).train()
    if fs.pure:
        model.to(dtype=torch.bfloat16)
    if fs.lora:
        from peft import LoraConfig
        from diffusers.training_utils import cast_training_params

        model.requires_grad_(False)
        model.to(dtype=fs.weight_dtype)
        if fs.nf4:
            quantize_blocks_nf4(model, device)
    if fs.recompute == "all":
        model.enable_gradient_checkpointing()
    if fs.lora:
        config = LoraConfig(r=fs.lora["rank"], lora_alpha=fs.lora["alpha"], init_lora_weights="gaussian",
                            target_modules=fs.lora["targets"])
        if hasattr(model, "add_adapter"):
            model.add_adapter(config)
        else:
            from peft import inject_adapter_in_model

            inject_adapter_in_model(config, model, "default")
        if not fs.pure:
            cast_training_params(model, dtype=torch.float32)
    return model


class Trainer(fp.FamilyTrainer):
    """The family peer's trainer with the GPU spec's model (`prepare`) and optimizers: 8-bit
    AdamW (paged or not) and fused AdamW."""

    def prepare(self, fs: GpuSpec, device):
        return prepare(fs, device)

    def optimizer(self):
        fs = self.fs
        foreach = fs.optimizer_impl == "foreach" and not fs.fused
        if fs.adam8:
            import bitsandbytes as bnb

            cls = bnb.optim.PagedAdamW8bit if fs.paged else bnb.optim.AdamW8bit
            return cls(self.trainable, **fp.ADAMW)
        if fs.optimizer == "adamw":
            kw = {"fused": True} if fs.fused else {"foreach": foreach}
            return torch.optim.AdamW(self.trainable, **kw, **fp.ADAMW)
        return torch.optim.SGD(self.trainable, lr=fp.SGD_LR, foreach=foreach)


def nvidia_smi_used(pid: int):
    """This process's used memory as nvidia-smi shows it (bytes), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1]) << 20  # MiB
    return None


def run(args) -> dict:
    with open(args.spec, encoding="utf-8") as f:
        raw = json.load(f)
    fs = GpuSpec(raw, args.device)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecUnsupported("CUDA requested but torch.cuda.is_available() is False")
        torch.cuda.init()
        free0, total = torch.cuda.mem_get_info(device)
    else:
        torch.set_num_threads(args.threads)
    if args.snapshot and device.type != "cuda":
        raise SpecUnsupported("a snapshot needs CUDA")
    tr = Trainer(fs, device, args.seed)
    counts = fp.param_counts(tr.model)
    if args.snapshot:
        torch.cuda.memory._record_memory_history(max_entries=args.snapshot_max_entries, stacks="python")
    tr.step()  # warm-up: the optimizer state exists afterwards
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        tr.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    p50 = statistics.median(times) if times else None
    common = {
        "spec": os.path.basename(args.spec),
        "params": {"total": counts["reported"], "trained": counts["trainable"]},
        "step_time_p50_s": p50,
        "step_times_s": times,
        "losses": tr.losses,
    }
    cond = {**fp.versions(), "device": device.type, "family": fs.family, "class": fs.cls,
            "precision": fs.precision, "checkpointing": fs.recompute == "all", "lora": fs.lora,
            "optimizer": "adamw-8bit" if fs.adam8 else fs.optimizer,
            "optimizer_impl": "fused" if fs.fused else fs.optimizer_impl, "nf4": fs.nf4,
            "latent": list(fs.latent), "image_tokens": fs.image_tokens, "text_tokens": fs.text_tokens,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "steps": args.steps}
    if device.type == "cuda":
        c = measure.cuda_step_peak(tr.step, device)
        torch.cuda.synchronize(device)
        if args.snapshot:
            torch.cuda.memory._dump_snapshot(args.snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
        free1, _ = torch.cuda.mem_get_info(device)
        smi = nvidia_smi_used(os.getpid())
        cond.update(device_name=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
        return {**common, "max_allocated": c["max_allocated"], "max_reserved": c["max_reserved"],
                "mem_get_info": {"free_before": free0, "free_after": free1, "total": total,
                                 "used_by_process": free0 - free1},
                "nvidia_smi_used": smi, "snapshot": args.snapshot, "conditions": cond,
                "method": "reset_peak_memory_stats before the measured step; max_memory_allocated/reserved after"}
    tr.opt.zero_grad(set_to_none=True)
    extra = [tr.inputs.acp] if hasattr(tr.inputs, "acp") else []
    resident = measure.tensor_bytes(measure.resident_tensors(tr.model, tr.opt, tr.ema) + extra)
    above, _net, _phases = measure.cpu_step_peak(tr.step)
    cond.update(threads=torch.get_num_threads())
    return {**common, "peak_bytes": resident + above, "resident_bytes": resident, "conditions": cond,
            "method": "torch.profiler profile_memory: resident + max running sum of [memory] events"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up (p50)")
    ap.add_argument("--threads", type=int, default=2, help="CPU only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--snapshot", metavar="FILE")
    ap.add_argument("--snapshot-max-entries", type=int, default=200000)
    args = ap.parse_args(argv)
    try:
        result = run(args)
    except (SpecUnsupported, ImportError, KeyError) as e:
        print(f"gpu_step: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    json.dump(result, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
