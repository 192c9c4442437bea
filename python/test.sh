#!/usr/bin/env bash
# The Python package's tests: creates python/.venv (pinned maturin + pytest) when missing,
# builds the `ditmem` binary (the tests hold the package's answers against its --json) and the
# extension into the venv (`maturin develop --release`, sharing the workspace's target/), then
# runs pytest. Torch is not installed: the `ditmem.torch` tests use a stand-in that records
# calls, and the real-torch tests run only where the venv (or DITMEM_TEST_PYTHON's) has torch.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
python="${PYTHON:-python3}"
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -r "$here/requirements-dev.txt"
fi
(cd "$root" && cargo build --release --quiet -p ditmem)
# `maturin develop` builds (cargo, release profile, the workspace's target/) and installs into
# the active virtualenv.
(cd "$here" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" "$venv/bin/maturin" develop --release --quiet)
export DITMEM_BIN="$root/target/release/ditmem"
cd "$here" && exec "$venv/bin/python" -m pytest -q tests "$@"
