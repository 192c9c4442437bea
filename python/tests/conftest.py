"""Shared helpers: the release binary (`DITMEM_BIN`, set by python/test.sh) run as the CLI."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("DITMEM_BIN", str(ROOT / "target" / "release" / "ditmem"))

# Keys whose values are timings of the run itself (never equal run to run).
VOLATILE = {"search_ms"}


def strip_volatile(value):
    if isinstance(value, dict):
        return {k: strip_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [strip_volatile(v) for v in value]
    return value


def flags(kwargs: dict) -> list:
    """kwargs as the CLI's flags (the test's own spelling, independent of api.rs)."""
    argv = []
    for k, v in kwargs.items():
        if k == "model":
            argv += ["--preset", v]
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            argv += [flag] if v else []
        elif isinstance(v, (list, tuple)):
            argv.append(f"{flag}={','.join(map(str, v))}")
        else:
            argv.append(f"{flag}={v}")
    return argv


def run_cli(command: str, argv: list):
    """(exit code, parsed --json or None, stderr)."""
    if not Path(BIN).exists():
        pytest.fail(f"{BIN} missing: run `cargo build --release -p ditmem` (python/test.sh does)")
    # --json before a `--` that ends the flags (oom's message)
    at = argv.index("--") if "--" in argv else len(argv)
    argv = [*argv[:at], "--json", *argv[at:]]
    p = subprocess.run([BIN, command, *argv], capture_output=True, text=True, check=False)
    out = json.loads(p.stdout) if p.stdout.strip() else None
    return p.returncode, out, p.stderr.strip()


@pytest.fixture(scope="session")
def cli():
    return run_cli
