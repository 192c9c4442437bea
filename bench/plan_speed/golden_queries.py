"""The queries the plan-speed golden test holds (plan_speed_cli.rs reads them as golden.json's keys)
and the figures of a plan it compares: everything but the search's own statistics (time taken,
timelines simulated) and the device profile's serialisation."""
# No ditmem-cpu query: that budget follows the host CPU (threads, gemm ISA, L1/L2, bf16 kernel).
QUERIES = [
    "--preset dit-xl-2 --resolution 512 --batch 32 --budget 24GiB --runtime pytorch:cuda",
    "--preset dit-xl-2 --batch 128 --gpu h100-sxm --ema on",
    "--preset dit-b-2 --batch 64 --gpu t4",
    "--preset dit-l-2 --resolution 512 --batch 16 --gpu rtx-4090 --allow 8bit",
    "--preset dit-xl-2 --resolution 512 --batch 64 --ranks 4 --gpu rtx-3090 --allow all",
    "--preset flux.1-dev --gpu rtx-4090 --allow lora,8bit,quant",
    "--preset sd3.5-medium --ranks 8 --gpu h100-sxm --allow all",
]

DROP = {"search_ms", "evaluated", "profile"}


def figures(plan):
    return {k: v for k, v in plan.items() if k not in DROP}


# `estimate` queries of `plan_speed_cli.rs`'s second reference (estimate_golden.json): the
# benchmark's `pytorch:cuda` estimates, and what each answer shows beyond the budget itself —
# what has to fit, whether it does, and every lever row (`ESTIMATE_KEYS`).
ESTIMATE_QUERIES = [
    "--preset dit-xl-2 --gpu a100-80gb --batch 128 --precision fp16-mixed --ema on --recompute all",
    "--preset dit-xl-2 --resolution 512 --batch 32 --gpu rtx-4090",
    "--preset flux.1-dev --gpu rtx-4090 --lora-rank 16 --base-quant nf4 --recompute all",
    "--preset sd3.5-medium --ranks 8 --zero 2 --gpu a100-40gb",
    "--preset sd3.5-large --ranks 16 --zero 3 --gpu h100-sxm --recompute all",
    "--preset pixart-sigma-1024 --gpu l4 --recompute all --optimizer adamw-8bit",
    "--preset sana-1600m --gpu a10g --recompute all",
    "--preset wan2.1-1.3b --gpu h100-sxm --recompute all",
    "--preset dit-xl-2 --batch 256 --microbatch 64 --gpu a100-40gb",
    "--preset flux.1-dev --gpu rtx-4090",
    "--preset dit-b-2 --gpu a100-80gb --attention materialized --batch 64",
]

ESTIMATE_KEYS = ["need_bytes", "fits", "peak_bytes", "cuda", "levers"]
