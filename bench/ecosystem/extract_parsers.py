"""Vendor the argument parsers of the diffusers example train scripts that ditmem's export names.

Reads each script from a diffusers git checkout at a pinned tag (diffusers' examples are not in its
wheel, and GitHub is not reachable from the check), and writes `vendor/diffusers_args/<script>.py`: the
script's module docstring line, its `parse_args` function copied verbatim (ast source segment) and
the imports that function uses. check.py calls that `parse_args` on every emitted command line; the
Rust tests read the same files to hold the flag lists in `crates/budget/src/export/scripts.rs`.

    python extract_parsers.py /path/to/diffusers v0.40.0
"""

import ast
import subprocess
import sys
from pathlib import Path

SCRIPTS = [
    "examples/dreambooth/train_dreambooth_sd3.py",
    "examples/dreambooth/train_dreambooth_lora_sd3.py",
    "examples/dreambooth/train_dreambooth_flux.py",
    "examples/dreambooth/train_dreambooth_lora_flux.py",
    "examples/dreambooth/train_dreambooth_lora_sana.py",
]

HEADER = '''# Vendored from huggingface/diffusers {tag} (commit {commit}), {path}
# (Apache-2.0, Copyright The HuggingFace Team): the script's parse_args, verbatim, so that
# bench/ecosystem/check.py parses ditmem's emitted command lines with the script's own argparse
# without the script's heavy imports. Regenerate with bench/ecosystem/extract_parsers.py.
import argparse
import os
import warnings

import logging

logger = logging.getLogger(__name__)


def is_torch_npu_available():
    return False


try:  # used by the choices of --image_interpolation_mode in train_dreambooth_flux.py
    from torchvision import transforms
except ImportError:  # torchvision's InterpolationMode members, for a venv without torchvision

    class transforms:  # noqa: N801
        class InterpolationMode:
            NEAREST = NEAREST_EXACT = BILINEAR = BICUBIC = BOX = HAMMING = LANCZOS = None


'''


def main():
    repo, tag = Path(sys.argv[1]), sys.argv[2]
    commit = subprocess.check_output(["git", "-C", str(repo), "rev-parse", f"{tag}^{{commit}}"], text=True).strip()
    out = Path(__file__).resolve().parent / "vendor" / "diffusers_args"
    out.mkdir(exist_ok=True)
    for path in SCRIPTS:
        src = subprocess.check_output(["git", "-C", str(repo), "show", f"{tag}:{path}"], text=True)
        tree = ast.parse(src)
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "parse_args")
        seg = ast.get_source_segment(src, fn)
        name = Path(path).stem
        (out / f"{name}.py").write_text(HEADER.format(tag=tag, commit=commit, path=path) + seg + "\n")
        print(name, commit)


if __name__ == "__main__":
    main()
