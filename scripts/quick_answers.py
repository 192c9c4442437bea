#!/usr/bin/env python3
"""Refresh the README's "Quick answers" from the built binary.

Runs each question's command with target/release/ditmem and writes its first lines (the answer)
between the README's quick-answers markers, so that the README shows real output of the code it
ships with. Usage: cargo build --release -p ditmem && python3 scripts/quick_answers.py
"""
import pathlib
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "ditmem"
OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
       "capacity of 23.65 GiB of which 1.20 GiB is free. Of the allocated memory 20.30 GiB is "
       "allocated by PyTorch, and 1.60 GiB is reserved by PyTorch but unallocated.")

# (question, command after `ditmem`, lines of output shown)
QUESTIONS = [
    ("FLUX.1-dev LoRA at 1024² on my RTX 4090?",
     ["estimate", "--preset", "flux.1-dev", "--lora-rank", "16", "--gpu", "rtx-4090"], 5),
    ("…and what should I change?",
     ["plan", "--preset", "flux.1-dev", "--lora-rank", "16", "--gpu", "rtx-4090",
      "--allow", "all"], 12),
    ("SD3.5-medium full fine-tune on 8×A100?",
     ["plan", "--preset", "sd3.5-medium", "--ranks", "8", "--gpu", "a100-80gb",
      "--allow", "sharding", "--emit", "diffusers", "--emit-out", "train.sh"], 12),
    ("PixArt-Σ at 1024², batch 4, on an A100-40GB?",
     ["estimate", "--preset", "pixart-sigma-1024", "--batch", "4", "--gpu", "a100-40gb"], 5),
    ("Wan 2.1 1.3B LoRA at 81×480×832?",
     ["estimate", "--preset", "wan2.1-1.3b", "--lora-rank", "16", "--gpu", "rtx-4090"], 5),
    ("My run OOMs — which lever?",
     ["oom", OOM, "--preset", "flux.1-dev", "--lora-rank", "16", "--gpu", "rtx-4090",
      "--allow", "quant"], 5),
]

# For these commands, also the lines from this marker on (the ranked levers), this many.
ALSO = {"oom": ("levers on", 12)}


def shown(args):
    parts = []
    for a in args:
        parts.append(shlex.quote(a) if a != OOM else '"torch.OutOfMemoryError: CUDA out of memory. '
                     'Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB …"')
    return "ditmem " + " ".join(parts)


def main():
    out = []
    for question, args, lines in QUESTIONS:
        r = subprocess.run([str(BIN), *args], capture_output=True, text=True, cwd="/tmp")
        if r.returncode not in (0, 3):
            sys.exit(f"{shown(args)}: exit {r.returncode}: {r.stderr}")
        all_lines = r.stdout.splitlines()
        kept = all_lines[:lines]
        if args[0] in ALSO:
            marker, n = ALSO[args[0]]
            at = next((i for i, l in enumerate(all_lines) if l.startswith(marker)), None)
            if at is not None:
                kept += ["…"] + all_lines[at:at + n]
        text = "\n".join(kept)
        out.append(f"**{question}**\n\n```console\n$ {shown(args)}\n{text}\n```\n")
    readme = ROOT / "README.md"
    s = readme.read_text()
    start, end = "<!-- quick-answers:start -->", "<!-- quick-answers:end -->"
    a, b = s.index(start) + len(start), s.index(end)
    readme.write_text(s[:a] + "\n" + "\n".join(out) + s[b:])


if __name__ == "__main__":
    main()
