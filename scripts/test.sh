#!/usr/bin/env bash
# Every test of the repository, in one command (the README's; `.ci/run` runs exactly this):
#   1. Chromium for the browser tests of `ditmem serve` (installed with apt-get when missing);
#   2. Rust: unit and integration tests of every crate, the browser and server tests included;
#   3. Python: the `ditmem` package (its own virtualenv python/.venv, maturin, pytest);
#   4. the GPU kit's plumbing on the CPU (bench/gpu/run.sh --cpu: tiny specs on the real diffusers
#      classes, PyTorch in bench/torch_peer/.venv, the predicted-vs-measured table end to end).
# Each stage prints its wall time; the first failure stops the run with its exit code.
set -euo pipefail
cd "$(dirname "$0")/.."
stage() {
    local name="$1"
    shift
    local start=$SECONDS
    echo "== $name: $*"
    "$@"
    echo "== $name: ok in $((SECONDS - start)) s"
}
stage browser-setup scripts/browser_setup.sh
stage rust cargo test --release --workspace
stage python python/test.sh
stage gpu-kit-cpu bench/gpu/run.sh --cpu
echo "== all tests passed in $SECONDS s"
