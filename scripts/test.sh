#!/usr/bin/env bash
# Every test of the repository, in one command (the README's; `.ci/run` runs exactly this):
#   1. Chromium for the browser tests of `ditmem serve` (installed with apt-get when missing);
#   2. Rust: unit and integration tests of every crate, the browser and server tests included;
#   3. Python: the `ditmem` package (its own virtualenv python/.venv, maturin, pytest);
#   4. the GPU kit's plumbing on the CPU (bench/gpu/run.sh --cpu: tiny specs on the real diffusers
#      classes, PyTorch in bench/torch_peer/.venv, the predicted-vs-measured table end to end);
#      that virtualenv is installed in the background from the start (peer-setup waits for it).
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
# The PyTorch peer's virtualenv for stage 4 (on a fresh machine ≈ 3 GB of wheels, about two
# minutes of download and unpacking; a few seconds of pip when it is there) is set up beside the
# Rust build, which keeps both cores busy with rustc while this waits on the network and the disk.
peer_log="$(mktemp "${TMPDIR:-/tmp}/ditmem-peer-setup.XXXXXX")"
peer_start=$SECONDS
bench/torch_peer/setup_diffusers.sh >"$peer_log" 2>&1 &
peer_pid=$!
# When a stage fails, the installation is waited for rather than killed: pip stopped half-way
# can leave a package whose metadata says installed and whose files are not all there.
trap 'if kill -0 "$peer_pid" 2>/dev/null; then echo "(waiting for the peer virtualenv setup to finish: $peer_log)" >&2; wait "$peer_pid" || true; fi' EXIT
peer_setup() {
    if ! wait "$peer_pid"; then
        cat "$peer_log" >&2
        echo "bench/torch_peer/setup_diffusers.sh failed (its output above)" >&2
        return 1
    fi
    tail -1 "$peer_log"
    echo "   (ran beside the stages above; done $((SECONDS - peer_start)) s after it started)"
    rm -f "$peer_log"
}
stage rust cargo test --release --workspace
stage python python/test.sh
stage peer-setup peer_setup
stage gpu-kit-cpu bench/gpu/run.sh --cpu
echo "== all tests passed in $SECONDS s"
