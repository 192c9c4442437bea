#!/usr/bin/env python3
"""DeepSpeed's own ZeRO model-state estimators beside ditmem's per-rank budget.

Runs in bench/ecosystem/.venv (setup.sh: deepspeed 0.19.8, diffusers 0.42.1, torch 2.15):

    bench/ecosystem/.venv/bin/python bench/ecosystem/zero_estimators.py [--ditmem target/release/ditmem]

For each model (DiT-XL/2 as diffusers' DiTTransformer2DModel, preset dit-xl-2-256; Flux.1-dev,
preset flux.1-dev) it takes the parameter count from `ditmem params --preset NAME --json` (held
equal to diffusers' own count below), the largest layer from the diffusers class built on the
meta device, and prints DeepSpeed's figures for 8 GPUs on one node, with and without offload,
then ditmem's model states and peak per rank for the same schemes.

DeepSpeed's formulas (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py, 0.19.8), P = total
parameters, N = GPUs, L = largest layer's parameters, f = additional_buffer_factor = 1.5:

  ZeRO-2  estimate_zero2_model_states_mem_needs
    no offload:  GPU = 2P + 18P/N      ("2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit +
                                         4_params_32bit + 8_optimizer_states_32bit")
                 CPU = 4P · N_per_node · f
    offload:     GPU = 2P
                 CPU = P · max(4N, 16) · f
  ZeRO-3  estimate_zero3_model_states_mem_needs (zero_init=True)
    no offload:            GPU = 4L + 18P/N          CPU = 4L · N_per_node · f
    offload optimizer:     GPU = 4L + 2P/N           CPU = 16P/nodes · f
    offload opt + params:  GPU = 4L                  CPU = 18P/nodes · f

They count model states only: no activations, no IPG / prefetch buffers, no allocator rounding.
"""

import argparse
import json
import subprocess
import sys

GIB = 2**30
RANKS = 8


def ds_figures(total, largest):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    out = {}
    for off in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total, num_gpus_per_node=RANKS, num_nodes=1, cpu_offload=off
        )
        out[("zero2", "optimizer" if off else "none")] = (gpu, cpu)
    for off, offp in ((False, False), (True, False), (True, True)):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            total,
            largest,
            num_gpus_per_node=RANKS,
            num_nodes=1,
            cpu_offload=off,
            cpu_offload_params=offp,
            zero_init=True,
        )
        key = "optimizer+params" if offp else ("optimizer" if off else "none")
        out[("zero3", key)] = (gpu, cpu)
    return out


def largest_layer(model):
    # deepspeed stage3.py model_to_params: the most parameters one module holds directly.
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def meta_model(name):
    from accelerate import init_empty_weights

    with init_empty_weights():
        if name == "flux.1-dev":
            from diffusers import FluxTransformer2DModel

            return FluxTransformer2DModel(guidance_embeds=True)
        from diffusers import DiTTransformer2DModel

        # facebook/DiT-XL-2-256 transformer/config.json: out_channels 8 (learned sigma).
        return DiTTransformer2DModel(out_channels=8)


def ditmem_json(binary, args):
    r = subprocess.run([binary] + args + ["--json"], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"ditmem {' '.join(args)} failed: {r.stderr.strip()}")
    return json.loads(r.stdout)


# (model, ditmem workload flags): DiT-XL/2 256², batch 32 per rank, bf16-mixed, AdamW, no EMA;
# Flux.1-dev 1024², batch 1 per rank, bf16-mixed, AdamW, every block checkpointed, no EMA.
MODELS = [
    ("dit-xl-2-256", ["--batch", str(32 * RANKS), "--ema", "off"]),
    (
        "flux.1-dev",
        ["--resolution", "1024", "--batch", str(RANKS), "--recompute", "all", "--ema", "off"],
    ),
]

SCHEMES = [
    ("DDP", [], None),
    ("ZeRO-1", ["--zero", "1"], None),
    ("ZeRO-1 + offload", ["--zero", "1", "--offload", "optimizer"], None),
    ("ZeRO-2", ["--zero", "2"], ("zero2", "none")),
    ("ZeRO-2 + offload", ["--zero", "2", "--offload", "optimizer"], ("zero2", "optimizer")),
    ("ZeRO-3", ["--zero", "3"], ("zero3", "none")),
    ("ZeRO-3 + offload opt", ["--zero", "3", "--offload", "optimizer"], ("zero3", "optimizer")),
    (
        "ZeRO-3 + offload opt+params",
        ["--zero", "3", "--offload", "optimizer+params"],
        ("zero3", "optimizer+params"),
    ),
    ("FSDP2 (no reshard)", ["--zero", "2", "--sharder", "fsdp"], None),
    ("FSDP2", ["--zero", "3", "--sharder", "fsdp"], None),
    (
        "FSDP2 + CPU offload",
        ["--zero", "3", "--sharder", "fsdp", "--offload", "optimizer+params"],
        None,
    ),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ditmem", default="target/release/ditmem")
    ap.add_argument("--gpu", default="h100-80gb")
    a = ap.parse_args()
    for name, flags in MODELS:
        total = ditmem_json(a.ditmem, ["params", "--preset", name])["params"]["total"]
        model = meta_model(name)
        diffusers_total = sum(p.numel() for p in model.parameters())
        assert diffusers_total == total, (name, diffusers_total, total)
        largest = largest_layer(model)
        ds = ds_figures(total, largest)
        print(f"\n## {name}: {total:,} parameters, largest layer {largest:,} ({RANKS} GPUs, 1 node)")
        print(
            "| scheme | DeepSpeed GPU | DeepSpeed CPU | ditmem model states | ditmem host "
            "| ditmem peak | allocated | reserved |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for label, extra, key in SCHEMES:
            b = ditmem_json(
                a.ditmem,
                ["estimate", "--preset", name, "--ranks", str(RANKS), "--runtime", "pytorch:cuda",
                 "--gpu", a.gpu] + flags + extra,
            )
            st = b["static_bytes"]
            states = st["weights"] + st["master_weights"] + st["optimizer_state"] + st["gradients"]
            c = b["cuda"] or {}
            g, cpu = ds.get(key, (None, None))
            f = lambda x: "—" if x is None else f"{x / GIB:.2f} GiB"
            print(
                f"| {label} | {f(g)} | {f(cpu)} | {f(states)} | {f(st['host_bytes'])} "
                f"| {f(b['peak_bytes'])} | {f(c.get('max_allocated_bytes'))} "
                f"| {f(c.get('max_reserved_bytes'))} |"
            )
    print("\nDeepSpeed's all_cold printouts:")
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold

    for name, _ in MODELS:
        total = ditmem_json(a.ditmem, ["params", "--preset", name])["params"]["total"]
        largest = largest_layer(meta_model(name))
        estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node=RANKS, num_nodes=1)
        estimate_zero3_model_states_mem_needs_all_cold(
            total, largest, num_gpus_per_node=RANKS, num_nodes=1
        )


if __name__ == "__main__":
    main()
