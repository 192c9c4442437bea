#!/usr/bin/env bash
# The Python package's tests: creates python/.venv (pinned maturin + pytest) when missing, builds
# the `ditmem` binary (the tests hold the package's answers against its --json) and the extension
# `ditmem._native`, installs the package into the venv in development mode, checks that maturin
# packages it, then runs pytest. Torch is not installed: the `ditmem.torch` tests use a stand-in
# that records calls, and the real-torch tests run only where the venv (or DITMEM_TEST_PYTHON's)
# has torch.
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
# One build for the whole test command: `--lib --bins --tests` over the workspace resolves the
# same features as `cargo test --release --workspace` (dev-dependencies' features and the
# engine's `mutations` included), so after that stage only pyo3 and the extension compile here.
# `maturin develop` resolves the python crate alone: other features, and with them a second
# build of candle and of every ditmem crate (≈ 400 s of the test command on 2 cores, measured
# 2026-12-07 on a fresh clone; bench/ci_time/README.md).
(cd "$root" && PYO3_PYTHON="$venv/bin/python" cargo build --release --quiet --workspace --lib --bins --tests)
# What `maturin develop` installs for this mixed layout (python-source = "."), done by hand: the
# extension beside the package's sources, under the name CPython's abi3 import looks for, and a
# .pth that puts python/ on the venv's path. The copy lands under a temporary name and is renamed,
# so an interrupted run never leaves half a module.
lib="$root/target/release/lib_native.so"
[ -f "$lib" ] || lib="$root/target/release/lib_native.dylib"
cp "$lib" "$here/ditmem/_native.abi3.so.tmp"
mv -f "$here/ditmem/_native.abi3.so.tmp" "$here/ditmem/_native.abi3.so"
# A copy installed earlier (`pip install ./python` into this venv) would shadow python/: removed.
if "$venv/bin/python" -m pip show --quiet ditmem >/dev/null 2>&1; then
    "$venv/bin/python" -m pip uninstall --quiet --yes ditmem
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\n' "$here" > "$site/ditmem.pth"
(cd / && "$venv/bin/python" -c 'import sys, ditmem; sys.exit(not ditmem.__file__.startswith(sys.argv[1]))' "$here/ditmem/") \
    || { echo "python/test.sh: the venv imports ditmem from elsewhere than $here" >&2; exit 1; }
# What `pip install ./python` reads, checked without compiling: maturin's source distribution
# must hold the Python sources, the py.typed marker and every crate the extension builds from.
sdist_dir="$(mktemp -d "${TMPDIR:-/tmp}/ditmem-sdist.XXXXXX")"
trap 'rm -rf "$sdist_dir"' EXIT
(cd "$here" && "$venv/bin/maturin" sdist --out "$sdist_dir" >"$sdist_dir/log" 2>&1) \
    || { cat "$sdist_dir/log" >&2; echo "python/test.sh: maturin sdist failed" >&2; exit 1; }
listing="$(tar tzf "$sdist_dir"/ditmem-*.tar.gz)"
for want in ditmem/__init__.py ditmem/torch.py ditmem/py.typed python/Cargo.toml Cargo.lock \
    crates/spec/Cargo.toml crates/budget/Cargo.toml crates/engine/Cargo.toml \
    crates/conformance/Cargo.toml crates/cli/Cargo.toml; do
    grep -q "/$want\$" <<<"$listing" || { echo "python/test.sh: the sdist lacks $want" >&2; exit 1; }
done
# `exec` below replaces this shell, and its EXIT trap with it: the folder goes now.
rm -rf "$sdist_dir"
trap - EXIT
export DITMEM_BIN="$root/target/release/ditmem"
cd "$here" && exec "$venv/bin/python" -m pytest -q tests "$@"
