#!/usr/bin/env bash
# Prepares the GPU kit to travel to a machine with no network that already has PyTorch (2.11,
# CUDA 13), accelerate, peft and transformers: downloads diffusers (pinned as the CPU peer's,
# 0.42.1) and its pure-Python needs, and bitsandbytes, into bench/gpu/wheels/ (git-ignored), and
# copies the stripped release binary to bench/gpu/bin/ditmem (git-ignored). Needs PyPI (pip
# download) and a release build here (cargo build --release -p ditmem).
#
#   bench/gpu/fetch_wheels.sh                 # Pythons 3.11–3.13 (diffusers 0.42 needs ≥ 3.11) (the binary wheels of each)
#   PY_VERSIONS="3.12" bench/gpu/fetch_wheels.sh
#
# What is left out, because every machine with transformers already has it: numpy and hf_xet
# (huggingface_hub's). bitsandbytes is repacked with only its CPU and CUDA 13 libraries
# (libbitsandbytes_cuda130/132.so): the full wheel is 43 MB, most of it CUDA 11/12 builds, and
# the run tool carries 64 MiB in all. Prints the kit's size at the end.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
wheels="$here/wheels"
py="${PYTHON:-python3}"
if [ -x "$root/bench/torch_peer/.venv/bin/python" ]; then py="$root/bench/torch_peer/.venv/bin/python"; fi
mkdir -p "$wheels" "$here/bin"
plats=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
       --platform manylinux_2_5_x86_64)
for v in ${PY_VERSIONS:-3.11 3.12 3.13}; do
    "$py" -m pip download -q --only-binary=:all: --python-version "$v" "${plats[@]}" -d "$wheels" \
        "diffusers==${DIFFUSERS_VERSION:-0.42.1}"
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 "${plats[@]}" -d "$wheels" \
    "bitsandbytes==${BNB_VERSION:-0.50.2}"
rm -f "$wheels"/numpy-*.whl "$wheels"/hf_xet-*.whl
# bitsandbytes: keep the CPU and CUDA 13 libraries, drop the others from the archive and RECORD.
"$py" - "$wheels" <<'PY'
import glob, os, sys, zipfile
for w in glob.glob(os.path.join(sys.argv[1], "bitsandbytes-*.whl")):
    keep = lambda n: not (n.startswith("bitsandbytes/libbitsandbytes_") and n.endswith(".so")
                          and not any(k in n for k in ("_cpu.so", "_cuda130.so", "_cuda132.so")))
    with zipfile.ZipFile(w) as z:
        names = z.namelist()
        if all(keep(n) for n in names):
            continue
        tmp = w + ".tmp"
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for n in names:
                if not keep(n):
                    continue
                data = z.read(n)
                if n.endswith(".dist-info/RECORD"):
                    data = "".join(l for l in data.decode().splitlines(True) if keep(l.split(",")[0])).encode()
                out.writestr(z.getinfo(n), data)
    os.replace(tmp, w)
    print("repacked", os.path.basename(w), os.path.getsize(w), "bytes")
PY
bin="$root/target/release/ditmem"
if [ ! -x "$bin" ]; then
    echo "fetch_wheels: $bin is missing: cargo build --release -p ditmem first" >&2
    exit 1
fi
cp "$bin" "$here/bin/ditmem"
strip "$here/bin/ditmem" 2>/dev/null || true
du -sh "$wheels" "$here/bin"
du -scb "$wheels" "$here/bin" | tail -1 | awk '{printf "kit: %.1f MiB to carry (the run tool carries 64 MiB)\n", $1/1048576}'
