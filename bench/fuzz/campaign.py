#!/usr/bin/env python3
"""Issue 50: a CLI fuzz campaign over every `ditmem` command (standard library only).

Generates seeded cases (flag values, presets, saved configs and mutated copies, special input and
output files, broken pipes, address-space limits), runs each against a binary with a timeout in a
sandbox, classifies the outcome and writes runs/<date>-<cpu>/{cases.jsonl,summary.json,summary.md}.
See README.md beside this file.
"""

import argparse
import datetime
import json
import os
import platform
import random
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SAVED = os.path.join(REPO, "crates/budget/tests/data/saved_configs")
PICKLES = os.path.join(REPO, "crates/budget/tests/data/snapshot_protocols")

EXIT_TABLE = {0, 1, 2, 3, 4, 5, 130}
# Failure classes, most severe first: the first one a case has is its class in the table.
FAILURES = [
    "hang",
    "panic",
    "abort",
    "signal",
    "bad_exit",
    "files_changed",
    "stray_file",
    "exit1_suspicious",
    "stderr_lines",
    "accepted_invalid",
]
# Outcomes that are not failures.
BENIGN = ["exit0", "exit1_io", "exit2", "exit3", "exit4", "exit5", "exit130", "sigpipe"]

DIT_PRESETS = [f"dit-{s}-{p}" for s in ("s", "b", "l", "xl") for p in (2, 4, 8)]
FAMILY_PRESETS = [
    "flux.1-dev",
    "flux.1-schnell",
    "sd3-medium",
    "sd3.5-medium",
    "sd3.5-large",
    "pixart-alpha-1024",
    "pixart-sigma-1024",
    "sana-600m",
    "sana-1600m",
    "wan2.1-1.3b",
    "wan2.1-14b",
    "dit-xl-2-256",
    "dit-xl-2-512",
]
GPUS = [
    "h200",
    "h100-sxm",
    "h100-pcie",
    "a100-80gb",
    "a100-40gb",
    "l40s",
    "a10g",
    "l4",
    "rtx-4090",
    "rtx-3090",
    "rtx-5090",
    "rtx-a6000",
    "t4",
    "v100-16gb",
    "v100-32gb",
]

# ---------------------------------------------------------------------------------------------
# Value pools: valid, boundary/huge, malformed (every flag also draws from the generic ones).

UNICODE = ["é", "😀", "\u202e", "\x1b[31m", "a\nb", "\t", "Ｄ", "\u00a0", "١٢", "ß" * 40, "\ud7ff"]
GENERIC_BAD = [
    "",
    " ",
    "-1",
    "-0",
    "+1",
    "1.5",
    "1e3",
    "0x10",
    "abc",
    "NaN",
    "inf",
    "-inf",
    "1e400",
    "4294967295",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "9" * 40,
    "9" * 3000,
    "x" * 5000,
    "--json",
    "-",
    "=",
    "1 2",
    "null",
    "true",
    "[1]",
    "{}",
    "１",
] + UNICODE

INT_SMALL = ["1", "2", "4", "8", "16", "32"]
INT_BOUND = ["0", "1024", "65535", "65536", "65537", "1048576", "1048577", "16777216", "4294967295"]


def pools():
    sizes_ok = ["24GiB", "24 GiB", "24G", "40G", "81920MiB", "1.5GiB", "80GB", "1TiB", "1048576"]
    sizes_edge = ["0", "1", "1B", "16EiB", "15EiB", "1PiB", "1e3GiB", "GiB", "1.5.5G", "24gib",
                  "-1GiB", " 24GiB ", "NaN GiB", "99999999999999999999GiB", "18446744073709551615"]
    return {
        "--resolution": (["32", "64", "128", "256", "512", "256x512", "512x256", "64x32"],
                         ["8", "16", "1", "1024", "2048", "4096", "8192", "65536", "65537", "4096x4096",
                          "65536x16", "65536x65536", "0", "0x0"],
                         ["256x", "x256", "256x256x3", "-256", "256X256", "256*256", "x", "256×256"]),
        "--batch": (INT_SMALL, INT_BOUND, []),
        "--microbatch": (INT_SMALL, INT_BOUND, []),
        "--accumulation": (["1", "2", "4"], INT_BOUND, []),
        "--ranks": (["1", "2", "8"], INT_BOUND, []),
        "--precision": (["fp64", "fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"], ["FP32", "fp32 ", "bf16"], []),
        "--optimizer": (["adamw", "adamw-8bit", "sgd"], ["AdamW", "adam"], []),
        "--attention": (["materialized", "memory-efficient", "math", "mem-efficient"], ["flash"], []),
        "--recompute": (["none", "all", "attention-only", "attention", "every-1", "every-2", "every-3",
                         "blocks:0", "blocks:0,2,4", "blocks: 0 , 1", "blocks:1,1,1"],
                        ["every-0", "every-4294967295", "every-4294967296", "blocks:99", "blocks:0,99999999999",
                         "blocks:1023", "blocks:" + ",".join(str(i) for i in range(2000))],
                        ["blocks:", "blocks:,,", "blocks:-1", "every-", "every--1", "every-x", "blocks:a"]),
        "--lora-rank": (["1", "4", "8", "64"], ["0", "384", "385", "65536", "4294967295"], []),
        "--lora-targets": (["qkv", "qkv,proj,fc1,fc2,adaln", "to_q,to_k,to_v,to_out.0", "attn.to_q"],
                           ["qkv,,", ",", "QKV"], ["bogus"]),
        "--zero": (["0", "1", "2", "3"], ["4", "255", "256"], []),
        "--sharder": (["deepspeed", "fsdp"], ["DeepSpeed", "fsdp2"], []),
        "--offload": (["none", "optimizer", "optimizer+params"], ["params", "optimizer+"], []),
        "--gradient-as-bucket-view": (["on", "off"], ["true", "1"], []),
        "--latents": (["encode", "cached"], ["Cached"], []),
        "--paged-optimizer": (["on", "off"], ["yes"], []),
        "--tf32": (["on", "off"], ["yes"], []),
        "--text-encoders": (["cached", "online", "offloaded"], ["offload"], []),
        "--ema": (["on", "off"], ["true", "ON"], []),
        "--runtime": (["ditmem-cpu", "ditmem", "engine", "pytorch", "pytorch:cpu", "pytorch:cuda",
                       "pytorch:cuda:flash", "pytorch:cuda:sdpa-efficient", "pytorch:cuda:cudnn",
                       "pytorch:cuda:math", "pytorch:cpu:sdpa-auto"],
                      ["pytorch:cuda:cpu:cuda", "pytorch::", "pytorch:", "PYTORCH", "pytorch:cuda:flash:math"],
                      ["pytorch:cuda:bogus", "pytorch:" + "x" * 5000, "torch"]),
        "--gpu": (GPUS, ["H100", "h100", "rtx", "a100-80gb "], []),
        "--alloc-conf": (["expandable_segments:True", "expandable_segments:False", "max_split_size_mb:128",
                          "roundup_power2_divisions:4", "roundup_power2_divisions:[256:1,512:2,>:4]",
                          "garbage_collection_threshold:0.5", "backend:native",
                          "expandable_segments:True,max_split_size_mb:200", "pinned_num_register_threads:8",
                          "release_lock_on_cudamalloc:True"],
                         ["max_split_size_mb:19", "max_split_size_mb:20", "max_split_size_mb:18446744073709551615",
                          "garbage_collection_threshold:1", "garbage_collection_threshold:nan",
                          "garbage_collection_threshold:0", "backend:cudaMallocAsync", "pinned_num_register_threads:3",
                          "roundup_power2_divisions:0", "roundup_power2_divisions:[>:0]",
                          "roundup_power2_divisions:[256:4294967297]", "expandable_segments:True," * 500],
                         ["a", "a:", "::::", ",,,", "expandable_segments:true", "[[[[[", "]", "max_split_size_mb",
                          "roundup_power2_divisions:[", "roundup_power2_divisions:[256:", ":True"]),
        "--cpu-threads": (["1", "2", "8"], ["0", "64", "1024", "4096", "65536"], []),
        "--bf16-products": (["kernel", "widen"], ["Kernel"], []),
        "--gemm-l2": (["1MiB", "2MiB", "512KiB", "1048576"], sizes_edge, []),
        "--text-tokens": (["77", "77,512", "77,256", "300", "512"],
                          ["0", "1", "1,2,3", "77,", ",77", "4294967296", "1048577", "1048576", "65536,65536"], []),
        "--frames": (["1", "5", "81"], ["0", "2", "4", "4294967295", "1048577", "100001"], []),
        "--base-quant": (["none", "int8", "nf4", "fp8"], ["fp4", "NF4"], []),
        # --depth N[,S]: fewer blocks at the real width (issue 51); D,S only where a model has two
        # kinds of block (Flux, SD3.5-medium), each count 1 to the model's blocks of that kind.
        "--depth": (["1", "2", "1,1", "2,1", "1,2"],
                    ["0", "0,1", "1,0", "57", "1000", "4294967296", "18446744073709551616", "1,1,1",
                     "19,38", "20,38"],
                    ["1,", ",1", "a", "-1", "1.5", "1;1", "1, 1", "one"]),
        "--optimizer-impl": (["for-loop", "foreach", "fused"], ["forloop", "for_loop"], []),
        # plan
        "--budget": (sizes_ok, sizes_edge, []),
        "--headroom": (["0", "0.05", "0.5", "0.2"], ["0.99", "1", "-0.1", "1e-300", "5e-324", "0.9999999"], []),
        "--allow": (["lora", "8bit", "sharding", "bf16-pure", "precision", "quant", "lora,8bit", "sharding,bf16-pure"],
                    ["all", "all,lora", "lora,lora", "", "none"], ["lora,,8bit", "LORA", "lora;8bit"]),
        "--emit": (["accelerate", "deepspeed", "deepspeed-standalone", "diffusers"], ["Accelerate"], []),
        "--emit-family": (["dit", "dit-diffusers", "pixart", "sd3", "flux", "sana", "wan"], ["DiT"], []),
        "--emit-sharder": (["deepspeed", "fsdp"], ["zero"], []),
        "--emit-offload": (["none", "optimizer", "optimizer+params"], ["params"], []),
        # run / verify
        "--warmup": (["0", "1"], ["4294967296"], []),
        "--steps": (["0", "1"], ["4294967296", "18446744073709551616"], []),
        "--seed": (["0", "1", "42", "18446744073709551615"], ["18446744073709551616"], []),
        "--data-seed": (["0", "7", "18446744073709551615"], ["18446744073709551616"], []),
        "--lr": (["1e-4", "0.001", "0.1"], ["0", "5e-324", "1e308", "1e-300", "nan", "inf", "-1e-4", "1e309"], []),
        "--variants": (["fp32/none/materialized", "bf16-mixed/all/memory-efficient", "fp32/blocks:0+2/materialized",
                        "fp32/none/memory-efficient", "fp32/attention-only/memory-efficient"],
                       ["fp32/none/materialized,fp32/none/materialized", "fp32/none/materialized,"],
                       ["bogus", "//", "fp32/none/materialized/extra", "fp32/blocks:/materialized", "/", ",",
                        "fp32/every-0/materialized", "fp99"]),
        "--jobs": (["1", "2"], ["0", "1000", "4294967296"], []),
        "--every": (["50", "100", "1000", "100000"], ["0", "4294967296", "18446744073709551616"], []),
        "--family": (["dit", "pixart", "sd3", "flux", "sana", "wan", "all"], ["DiT", "bogus"], []),
        "--device": (["0", "1"], ["4294967296", "99"], []),
    }


POOLS = pools()

SPEC_FLAGS = [
    "--resolution", "--batch", "--microbatch", "--accumulation", "--ranks", "--precision", "--optimizer",
    "--attention", "--recompute", "--lora-rank", "--lora-targets", "--zero", "--sharder", "--offload",
    "--gradient-as-bucket-view", "--latents", "--paged-optimizer", "--tf32", "--text-encoders", "--ema", "--runtime",
    "--gpu", "--alloc-conf", "--cpu-threads", "--bf16-products", "--gemm-l2", "--text-tokens", "--frames",
    "--base-quant", "--optimizer-impl", "--depth",
]
PLAN_FLAGS = ["--budget", "--headroom", "--allow", "--emit", "--emit-family", "--emit-sharder", "--emit-offload"]
# Values for run-type commands: tiny (fast) or clearly refused; never a valid value that makes a
# long step (a big resolution or batch is either refused by validation or by the memory guard).
RUN_SAFE = {
    "--resolution": (["32", "16", "32x64", "64x32"], ["4096", "65536", "8192x8192", "0"], ["32x", "x", "-32"]),
    "--batch": (["1", "2"], ["0", "1048576", "4294967296"], []),
    "--microbatch": (["1"], ["0", "4294967296"], []),
    "--accumulation": (["1"], ["0", "4294967296"], []),
    "--ranks": (["1"], ["0", "4294967296"], []),
    "--lora-rank": (["4"], ["0", "385", "4294967296"], []),
    "--cpu-threads": (["1", "2"], ["0", "4294967296"], []),
    "--frames": (["1"], ["0", "4294967296"], []),
    "--text-tokens": (["8"], ["0", "4294967296"], []),
    "--depth": (["1", "2"], ["0", "1,1", "99", "4294967296"], ["1,", "a"]),
}


# Values of the generic pools that a flag accepts (so a case drawing them is not a fault).
ACCEPTED = {
    "--seed": {"4294967295", "4294967296", "18446744073709551615"},
    "--data-seed": {"4294967295", "4294967296", "18446744073709551615"},
    "--lora-rank": {"0"},
    "--ema": {"true"},
    "--gradient-as-bucket-view": {"true", "1"},
    "--lr": {"+1"},
}

# Flags that take a list and may be given more than once (clap appends).
REPEATABLE = {"--allow"}


def pick_value(rng, flag, safe=False, fault=False):
    pool = RUN_SAFE.get(flag) if safe else None
    pool = pool or POOLS.get(flag, (INT_SMALL, INT_BOUND, []))
    valid, edge, bad = pool
    if fault:
        # A value that must be refused: malformed (the flag's own, else generic garbage), less
        # what the flag accepts: Rust's integer parsing takes a leading '+', seeds are u32/u64,
        # `--lora-rank 0` turns LoRA off, the switches take true.
        ok = set(valid) | {"+1"} | ACCEPTED.get(flag, set())
        choices = bad + [v for v in GENERIC_BAD if v not in ok]
        if safe:
            choices += [
                v for v in edge if v in ("0", "4294967296", "18446744073709551616") and v not in ok
            ]
        return rng.choice(choices)
    r = rng.random()
    if r < 0.6 or (safe and r < 0.85):
        return rng.choice(valid)
    if r < 0.85:
        return rng.choice(edge or valid) if not safe else rng.choice(RUN_SAFE.get(flag, pool)[1] or valid)
    return rng.choice(bad + GENERIC_BAD)


# ---------------------------------------------------------------------------------------------
# Fixtures: a deterministic sandbox of input files, mutated copies and special files.


def json_mutations(rng, obj, hostile_keys=True):
    """One structural mutation of a JSON object: a value nulled, of the wrong type, huge,
    negative, deeply nested, unicode; a key removed or added. Returns (obj, raw replacements)."""
    obj = json.loads(json.dumps(obj))
    raw = {}
    paths = []

    def walk(o, p):
        if isinstance(o, dict):
            for k, v in o.items():
                paths.append(p + [k])
                walk(v, p + [k])
        elif isinstance(o, list):
            for i, v in enumerate(o):
                paths.append(p + [i])
                walk(v, p + [i])

    walk(obj, [])
    tok = "@@RAW%d@@"
    values = [
        None, "", "x", [], {}, True, False, 0, -1, 1.5, -0.0, 2**31, 2**32, 2**53 + 1, 2**63, 2**64, 2**64 + 1,
        -(2**63) - 1, 1e308, 65536, 1048577, 4096, 1024, 3, [1, 2], {"a": 1}, "😀" * 10, "\u0000", "a" * 10000,
        [None], [2**64], [-1, -1],
    ]
    for _ in range(rng.randint(1, 3)):
        paths = []
        walk(obj, [])
        if not paths:
            break
        path = rng.choice(paths)
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        how = rng.random()
        if how < 0.55:
            v = rng.choice(values)
            if rng.random() < 0.15:
                name = tok % len(raw)
                raw[json.dumps(name)] = rng.choice(
                    ["1e400", "-1e400", "1" + "0" * 400, "NaN", "Infinity", "[" * 200 + "]" * 200,
                     "[" * 100000 + "]" * 100000, "0.0000000000000000000000001", "-0"])
                v = name
            parent[key] = v
        elif how < 0.75 and isinstance(parent, dict):
            del parent[key]
        elif isinstance(parent, dict):
            parent[rng.choice(["unknown_key", str(key) + "_", "😀", "", "__proto__"])] = rng.choice(values[:12])
        else:
            parent.append(rng.choice(values))
    text = json.dumps(obj, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.5)
    for k, v in raw.items():
        text = text.replace(k, v)
    return text


def text_mutation(rng, text):
    b = bytearray(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    how = rng.randrange(8)
    if how == 0 and b:
        b = b[: rng.randrange(len(b))]
    elif how == 1 and b:
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif how == 2:
        b = bytearray(b"\xef\xbb\xbf") + b
    elif how == 3:
        b += rng.choice([b"\x00", b"garbage", b"}", b"\n[model]\n", b"\xff\xfe"])
    elif how == 4 and b:
        i = rng.randrange(len(b))
        b[i:i] = rng.choice([b"\x00", b"\"", b"\\", b"\n", "😀".encode(), b"\xc3"])
    elif how == 5 and b:
        i = rng.randrange(len(b))
        j = min(len(b), i + rng.randrange(64))
        b[j:j] = b[i:j] * rng.randint(2, 50)
    elif how == 6:
        b = b.replace(b'"', b"'", rng.randint(1, 5))
    else:
        b = b.replace(b"\n", b"\r\n")
    return bytes(b)


def toml_mutation(rng, text):
    lines = text.splitlines()
    hostile = ["0", "-1", "4294967296", "18446744073709551616", "nan", "inf", "1e400", "\"\"", "[1, 2]",
               "{ a = 1 }", "true", "\"😀\"", "\"" + "x" * 6000 + "\"", "0.5", "\"blocks:\"", "\"every-0\"",
               "1979-05-27T07:32:00Z", "'''\nmulti\n'''", "[[]]"]
    for _ in range(rng.randint(1, 3)):
        if not lines:
            break
        i = rng.randrange(len(lines))
        how = rng.randrange(6)
        if how == 0:
            del lines[i]
        elif how == 1 and "=" in lines[i]:
            k = lines[i].split("=", 1)[0]
            lines[i] = k + "= " + rng.choice(hostile)
        elif how == 2:
            lines.insert(i, lines[i])
        elif how == 3:
            lines.insert(i, rng.choice(["[bogus]", "[model]", "bogus = 1", "[recipe.ema.x]", "[[model]]"]))
        elif how == 4 and "=" in lines[i]:
            lines[i] = lines[i].split("=", 1)[0] + "= " + rng.choice(INT_BOUND + ["\"x\""])
        else:
            lines[i] = lines[i] + rng.choice([" # c", " x", "\x00", "="])
    out = "\n".join(lines)
    if rng.random() < 0.3:
        return text_mutation(rng, out)
    return out.encode()


def npy(shape, descr="<f4", fortran=False, data=None, version=(1, 0), header=None, hlen=None):
    if header is None:
        header = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (
            descr, "True" if fortran else "False", shape if isinstance(shape, str) else repr(tuple(shape)))
    h = header.encode("latin1")
    fmt = "<H" if version[0] == 1 else "<I"
    pre = 10 if version[0] == 1 else 12
    pad = (64 - (pre + len(h) + 1) % 64) % 64
    h = h + b" " * pad + b"\n"
    n = len(h) if hlen is None else hlen
    if data is None:
        count = 1
        if not isinstance(shape, str):
            for d in shape:
                count *= d
        data = b"\x00\x00\x80\x3f" * min(count, 1 << 16)
    return b"\x93NUMPY" + bytes(version) + struct.pack(fmt, n) + h + data


def safetensors(entries, meta=None, hlen=None, header=None, pad_data=0):
    """entries: {name: (dtype, shape, (a, b))}; data sized to the largest end offset."""
    if header is None:
        h = {}
        if meta is not None:
            h["__metadata__"] = meta
        end = 0
        for name, (dt, shape, offs) in entries.items():
            h[name] = {"dtype": dt, "shape": shape, "data_offsets": list(offs)}
            try:
                end = max(end, int(offs[1]))
            except Exception:
                pass
        header = json.dumps(h).encode()
        data = b"\x00" * (min(end, 1 << 20) + pad_data)
    else:
        data = b"\x00" * pad_data
    n = len(header) if hlen is None else hlen
    return struct.pack("<Q", n % (1 << 64)) + header + data


def pickle_mutants(rng, base):
    out = []
    for _ in range(60):
        out.append(text_mutation(rng, base))
    # Crafted: huge lengths, deep nesting, memo holes, many marks, unsupported opcodes.
    out += [
        b"\x80\x05\x8d" + struct.pack("<Q", 2**63) + b"abc.",  # BINUNICODE8 huge
        b"\x80\x04\x8e" + struct.pack("<Q", 2**64 - 1) + b".",  # BINBYTES8
        b"\x80\x02\x8b" + struct.pack("<i", 2**31 - 1) + b"\x01.",  # LONG4 huge
        b"\x80\x02\x8b" + struct.pack("<i", -5) + b".",  # LONG4 negative length
        b"\x80\x02" + b"]" * 200000 + b"a" * 199999 + b".",  # deep list nesting
        b"\x80\x02" + b"(" * 1000000 + b".",  # many marks
        b"\x80\x02h\xff.",  # BINGET of an unknown memo
        b"\x80\x02}q\x00h\x00h\x00s.",  # a dict that holds itself
        b"\x80\x02]q\x00h\x00a.",  # a list that holds itself
        b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00lsq\x01\x85R.",  # GLOBAL + REDUCE
        b"\x80\x02}(X\x08\x00\x00\x00segments]X\x0d\x00\x00\x00device_traces]u.",  # minimal
        b"\x80\x02}(X\x08\x00\x00\x00segmentsNX\x0d\x00\x00\x00device_traces]]u.",
        b"\x80\x02}(X\x08\x00\x00\x00segments]X\x0d\x00\x00\x00device_traces" + b"]" * 5 + b"e" * 4 + b"u.",
        b"\x80\x02J\xff\xff\xff\xff.",
        b"\x80\x02G\x7f\xf8\x00\x00\x00\x00\x00\x00.",  # NaN float at the top
        b"(I1\nI2\nl.",  # protocol 0 list
        b"V\\u00e9\\ud800\np0\n.",  # raw-unicode-escape lone surrogate
        b"L" + b"9" * 10000 + b"L\n.",  # protocol 0 long, huge
        b"\x80\x06.",  # unknown protocol
        b"\x80",
        b".",
        b"\x00" * 100,
        b"\x80\x02" + b"X\x00\x00\x00\x00\x94" * 1000 + b".",  # MEMOIZE many
        b"\x80\x04\x95" + struct.pack("<Q", 2**62) + b"}.",  # FRAME huge
    ]
    return out


def build_fixtures(fix, binary, seed):
    """Writes every input the cases name under `fix`; returns the catalog of names by kind."""
    rng = random.Random(f"fixtures:{seed}")
    if os.path.exists(fix):
        shutil.rmtree(fix)
    cat = {"config": [], "spec": [], "profile": [], "pickle": [], "weights": [], "latents": [], "model_dir": []}
    for d in ("configs", "specs", "profiles", "pickles", "weights", "latents", "special", "models"):
        os.makedirs(os.path.join(fix, d))

    def put(kind, rel, data):
        p = os.path.join(fix, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())
        if kind:
            cat[kind].append("{F}/" + rel)
        return p

    # Diffusers configs: every saved one, a folder form, and mutated copies.
    saved = sorted(f for f in os.listdir(SAVED) if f.endswith(".json"))
    bases = {}
    for f in saved:
        with open(os.path.join(SAVED, f)) as fh:
            bases[f] = json.load(fh)
        put("config", f"configs/{f}", json.dumps(bases[f]))
    for f in saved[:6]:
        put(None, f"models/{f[:-5]}/config.json", json.dumps(bases[f]))
        cat["model_dir"].append(f"{{F}}/models/{f[:-5]}")
    os.makedirs(os.path.join(fix, "models/empty"))
    cat["model_dir"] += ["{F}/models/empty", "{F}/models/empty/"]
    for i in range(240):
        f = rng.choice(saved)
        text = json_mutations(rng, bases[f])
        data = text_mutation(rng, text) if rng.random() < 0.25 else text.encode()
        put("config", f"configs/m{i:03d}_{f}", data)

    # Specs: the binary's own JSON and TOML of presets, and mutated copies.
    spec_bases = []
    for p in ["dit-s-2", "dit-xl-2", "dit-b-4"] + FAMILY_PRESETS:
        for fmt in ("json", "toml"):
            args = [binary, "spec", "--preset", p] + (["--json"] if fmt == "json" else [])
            try:
                r = subprocess.run(args, capture_output=True, timeout=30)
            except Exception:
                continue
            if r.returncode == 0 and r.stdout:
                name = f"specs/{p}.{fmt}"
                put("spec", name, r.stdout)
                spec_bases.append((p, fmt, r.stdout.decode("utf-8", "replace")))
    for i in range(160):
        if not spec_bases:
            break
        p, fmt, text = rng.choice(spec_bases)
        if fmt == "json":
            data = json_mutations(rng, json.loads(text))
            data = text_mutation(rng, data) if rng.random() < 0.25 else data.encode()
        else:
            data = toml_mutation(rng, text)
        ext = fmt if rng.random() < 0.9 else rng.choice(["json", "toml", "txt", ""])
        put("spec", f"specs/m{i:03d}_{p}.{ext}".rstrip("."), data)
    put("spec", "specs/json_in_toml.toml", '{"model": {}}')
    put("spec", "specs/empty.toml", "")
    put("spec", "specs/big.toml", "# " + "x" * (1 << 20) + "\n")
    put("spec", "specs/deep.json", "[" * 100000 + "]" * 100000)
    put("spec", "specs/deep.toml", "a = " + "[" * 100000 + "]" * 100000)

    # Device profiles: garbage and near-valid.
    prof = {"name": "p", "matmul_flops": 1e12, "bandwidth": 1e11}
    for i in range(30):
        data = json_mutations(rng, prof).encode()
        put("profile", f"profiles/m{i:02d}.json", data)
    put("profile", "profiles/rates.toml", "name = 'x'\nmatmul_flops = 1e300\nbandwidth = 0\n")

    # Snapshots: the protocol pickles and mutated copies.
    pk = sorted(f for f in os.listdir(PICKLES) if f.endswith(".pickle"))
    for f in pk:
        with open(os.path.join(PICKLES, f), "rb") as fh:
            b = fh.read()
        put("pickle", f"pickles/{f}", b)
    with open(os.path.join(PICKLES, pk[-1]), "rb") as fh:
        base = fh.read()
    for i, b in enumerate(pickle_mutants(rng, base)):
        put("pickle", f"pickles/m{i:03d}.pickle", b)

    # Safetensors checkpoints for params --weights.
    good = {"a.weight": ("F32", [2, 2], (0, 16)), "b": ("BF16", [4], (16, 24))}
    st = {
        "good.safetensors": safetensors(good),
        "meta.safetensors": safetensors(good, meta={"format": "pt"}),
        "hlen_max.safetensors": safetensors(good, hlen=2**64 - 1),
        "hlen_file.safetensors": safetensors(good, hlen=200),
        "hlen_100m.safetensors": safetensors(good, hlen=100_000_001),
        "not_json.safetensors": safetensors({}, header=b"{not json"),
        "array.safetensors": safetensors({}, header=b"[1,2,3]"),
        "deep.safetensors": safetensors({}, header=b"[" * 100000 + b"]" * 100000),
        "dtype.safetensors": safetensors({"a": ("F128", [1], (0, 16))}),
        "shape_overflow.safetensors": safetensors({"a": ("F32", [2**63, 2**63], (0, 16))}),
        "shape_neg.safetensors": safetensors({"a": ("F32", [-1], (0, 4))}),
        "offsets_rev.safetensors": safetensors({"a": ("F32", [1], (8, 4))}),
        "offsets_out.safetensors": safetensors({"a": ("F32", [2**40], (0, 2**42))}),
        "offsets_huge.safetensors": safetensors({"a": ("F32", [1], (2**64 - 4, 2**64))}),
        "offsets_short.safetensors": safetensors({"a": ("F32", [1], (0,))}),
        "null_entry.safetensors": safetensors({}, header=b'{"a": null}'),
        "unicode.safetensors": safetensors({"\u202e😀": ("F32", [1], (0, 4))}),
        "empty.safetensors": b"",
        "short.safetensors": b"\x01\x00\x00",
        "zero_header.safetensors": struct.pack("<Q", 0),
    }
    for i in range(30):
        st[f"m{i:02d}.safetensors"] = text_mutation(rng, st["good.safetensors"])
    for name, data in st.items():
        put("weights", f"weights/{name}", data)
    idx = {
        "index_ok.index.json": {"weight_map": {"a.weight": "good.safetensors", "b": "good.safetensors"}},
        "index_missing.index.json": {"weight_map": {"a": "nope.safetensors"}},
        "index_traversal.index.json": {"weight_map": {"a": "../../../../../../etc/passwd"}},
        "index_abs.index.json": {"weight_map": {"a": "/dev/zero"}},
        "index_fifo.index.json": {"weight_map": {"a": "../special/fifo"}},
        "index_many.index.json": {"weight_map": {f"t{i}": f"s{i}.safetensors" for i in range(3000)}},
        "index_self.index.json": {"weight_map": {"a": "index_self.index.json"}},
        "index_null.index.json": {"weight_map": None},
        "index_wrong.index.json": {"weight_map": {"a": 5}},
        "index_empty.index.json": {},
    }
    for name, obj in idx.items():
        put("weights", f"weights/{name}", json.dumps(obj))

    # Latent folders for run --latents-dir (the tiny spec's latents are 4×4×4).
    lat = {
        "ok_npy": [("a.npy", npy((1, 4, 4, 4)))],
        "ok_npy2": [("a.npy", npy((2, 4, 4, 4))), ("b.npy", npy((1, 4, 4, 4), descr="<f8",
                                                                data=b"\x00" * 8 * 64))],
        "ok_st": [("a.safetensors", safetensors({"x": ("F32", [1, 4, 4, 4], (0, 256))}))],
        "huge_shape": [("a.npy", npy((2**64 - 1, 4, 4, 4), data=b"\x00" * 256))],
        "huge_shape2": [("a.npy", npy((2**31, 2**31, 4, 4), data=b"\x00" * 256))],
        "big_shape": [("a.npy", npy((1 << 40, 4, 4, 4), data=b"\x00" * 256))],
        "zero_shape": [("a.npy", npy((0, 4, 4, 4), data=b""))],
        "neg_shape": [("a.npy", npy("(-1, 4, 4, 4)", data=b"\x00" * 256))],
        "wrong_shape": [("a.npy", npy((1, 3, 4, 4)))],
        "scalar": [("a.npy", npy(()))],
        "truncated": [("a.npy", npy((4, 4, 4, 4))[:200])],
        "bad_magic": [("a.npy", b"\x93NUMPX" + npy((1, 4, 4, 4))[6:])],
        "hlen_huge": [("a.npy", npy((1, 4, 4, 4), hlen=65535))],
        "v2_hlen_huge": [("a.npy", npy((1, 4, 4, 4), version=(2, 0), hlen=2**32 - 1))],
        "v3": [("a.npy", npy((1, 4, 4, 4), version=(3, 0)))],
        "v9": [("a.npy", npy((1, 4, 4, 4), version=(9, 0)))],
        "fortran": [("a.npy", npy((1, 4, 4, 4), fortran=True))],
        "complex": [("a.npy", npy((1, 4, 4, 4), descr="<c8", data=b"\x00" * 512))],
        "object": [("a.npy", npy((1, 4, 4, 4), descr="|O", data=b"\x00" * 512))],
        "big_endian": [("a.npy", npy((1, 4, 4, 4), descr=">f4"))],
        "f2": [("a.npy", npy((1, 4, 4, 4), descr="<f2", data=b"\x00" * 128))],
        "i8": [("a.npy", npy((1, 4, 4, 4), descr="<i8", data=b"\x00" * 512))],
        "garbage_header": [("a.npy", npy((1,), header="{'descr': lambda: 0, }"))],
        "empty_file": [("a.npy", b"")],
        "empty_dir": [],
        "st_huge_hlen": [("a.safetensors", safetensors({}, header=b"{}", hlen=2**64 - 1))],
        "st_shape_overflow": [("a.safetensors", safetensors({"x": ("F32", [2**62, 8], (0, 256))}))],
        "st_garbage": [("a.safetensors", text_mutation(rng, safetensors({"x": ("F32", [1, 4, 4, 4], (0, 256))})))],
        "nan": [("a.npy", npy((1, 4, 4, 4), data=b"\x00\x00\xc0\x7f" * 64))],
    }
    for i in range(20):
        lat[f"m{i:02d}"] = [("a.npy", text_mutation(rng, npy((1, 4, 4, 4))))]
    for name, files in lat.items():
        d = os.path.join(fix, "latents", name)
        os.makedirs(d, exist_ok=True)
        for fn, data in files:
            with open(os.path.join(d, fn), "wb") as f:
                f.write(data)
        cat["latents"].append("{F}/latents/" + name)
    # Special entries inside latent folders.
    d = os.path.join(fix, "latents", "fifo")
    os.makedirs(d)
    os.mkfifo(os.path.join(d, "a.npy"))
    d = os.path.join(fix, "latents", "dir_named_npy")
    os.makedirs(os.path.join(d, "a.npy"))
    d = os.path.join(fix, "latents", "link_zero")
    os.makedirs(d)
    os.symlink("/dev/zero", os.path.join(d, "a.npy"))
    d = os.path.join(fix, "latents", "sparse")
    os.makedirs(d)
    with open(os.path.join(d, "a.npy"), "wb") as f:
        f.write(npy((1, 4, 4, 4)))
        f.truncate(8 << 30)
    cat["latents"] += ["{F}/latents/fifo", "{F}/latents/dir_named_npy", "{F}/latents/link_zero",
                       "{F}/latents/sparse"]

    # Special files: used as inputs everywhere and as (refused) output targets.
    sp = os.path.join(fix, "special")
    with open(os.path.join(sp, "regular.txt"), "w") as f:
        f.write("do not touch\n")
    os.mkfifo(os.path.join(sp, "fifo"))
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(sp, "sock"))
    s.close()
    os.makedirs(os.path.join(sp, "dir"))
    os.symlink("regular.txt", os.path.join(sp, "link_file"))
    os.symlink("missing_target", os.path.join(sp, "link_dangling"))
    os.symlink("loop_b", os.path.join(sp, "loop_a"))
    os.symlink("loop_a", os.path.join(sp, "loop_b"))
    os.symlink("dir", os.path.join(sp, "link_dir"))
    open(os.path.join(sp, "empty"), "w").close()
    with open(os.path.join(sp, "sparse_huge"), "wb") as f:
        f.truncate(16 << 30)
    with open(os.path.join(sp, "nul"), "wb") as f:
        f.write(b"\x00" * 4096)
    with open(os.path.join(sp, "binary"), "wb") as f:
        f.write(bytes(rng.randrange(256) for _ in range(8192)))
    with open(os.path.join(sp, "ünï©ødé-😀.json"), "w") as f:
        f.write("{}")
    with open(os.path.join(sp, "a" * 250), "w") as f:
        f.write("{}")
    with open(os.path.join(sp, "big.json"), "wb") as f:
        f.write(b'{"a": "' + b"x" * (2 << 20) + b'"}')
    return cat


SPECIAL_IN = [
    "{F}/special/fifo", "{F}/special/sock", "{F}/special/dir", "{F}/special/dir/", "{F}/special/link_file",
    "{F}/special/link_dangling", "{F}/special/loop_a", "{F}/special/link_dir", "{F}/special/empty",
    "{F}/special/sparse_huge", "{F}/special/nul", "{F}/special/binary", "{F}/special/ünï©ødé-😀.json",
    "{F}/special/" + "a" * 250, "{F}/special/big.json", "/dev/null", "/dev/zero", "/dev/urandom",
    "/dev/full", "/proc/self/status", "/nonexistent/x.toml", "", "{F}/special/regular.txt/",
    "{F}/special/" + "b" * 300, "{F}/" + "x/" * 2100 + "y",
]
# Hang-prone inputs (a FIFO opened for reading blocks forever): drawn rarely, each costs a timeout
# when the binary opens it.
HANG_PRONE = {"{F}/special/fifo", "{F}/latents/fifo", "/dev/zero", "/dev/urandom"}


def special_in(rng):
    v = rng.choice(SPECIAL_IN)
    if v in HANG_PRONE and rng.random() < 0.7:
        v = rng.choice(SPECIAL_IN)
    return v


# Output targets: (path, expect_refused, setup). setup: what the case dir holds before the run.
def output_target(rng, ext):
    r = rng.random()
    if r < 0.35:
        return ("{C}/out" + ext, False, [])
    if r < 0.45:
        return ("{C}/existing" + ext, False, [("file", "existing" + ext, "old\n")])
    if r < 0.5:
        return ("{C}/" + "n" * 240 + ext, False, [])
    if r < 0.53:
        return ("{C}/ünï©ødé-😀" + ext, False, [])
    if r < 0.55:
        return ("out" + ext, False, [])  # relative to the case dir
    bad = [
        ("{C}/new" + ext + "/", []),
        ("{C}/newdir/", []),
        ("{C}/missing/dir/out" + ext, []),
        ("{C}/existing" + ext + "/", [("file", "existing" + ext, "old\n")]),
        ("{C}", []),
        ("{C}/", []),
        ("{F}/special/dir", []),
        ("{F}/special/dir/", []),
        ("{F}/special/fifo", []),
        ("{F}/special/sock", []),
        ("{F}/special/link_file", []),
        ("{F}/special/link_dangling", []),
        ("{F}/special/link_dir", []),
        ("{F}/special/loop_a", []),
        ("{C}/link_out" + ext, [("link", "link_out" + ext, "{F}/special/regular.txt")]),
        ("/dev/full", []),
        ("/dev/null", []),
        ("{C}/" + "n" * 256 + ext, []),
        ("{C}/" + "n" * 255, []),
        ("{C}/" + "d/" * 2100 + "o" + ext, []),
        ("", []),
        ("{C}/file_as_dir/out" + ext, [("file", "file_as_dir", "x")]),
        ("/proc/self/status", []),
        ("{F}/special/regular.txt/", []),
    ]
    p, setup = rng.choice(bad)
    # A 255-byte name is NAME_MAX itself: a valid new file that must be written (ditmem keeps its
    # temporary name under the limit), not refused. It stays in this draw so that the seeded case
    # ids are those of earlier runs.
    if p == "{C}/" + "n" * 255:
        return (p, False, setup)
    return (p, True, setup)


# ---------------------------------------------------------------------------------------------
# Case generation.

COMMAND_WEIGHTS = [
    ("estimate", 35), ("spec", 16), ("plan", 10), ("params", 11), ("gpus", 4), ("compare", 11),
    ("run", 4.5), ("verify", 2), ("agree", 0.5), ("top", 5),
]

TINY = ["--preset", "dit-s-2", "--resolution", "32", "--batch", "1"]


def add_flags(rng, argv, flags, n, safe=False, case=None):
    for _ in range(n):
        f = rng.choice(flags)
        v = pick_value(rng, f, safe=safe)
        form = rng.random()
        if form < 0.85:
            argv += [f, v]
        elif form < 0.92:
            argv.append(f"{f}={v}")
        elif form < 0.96:
            argv += [f, v, f, pick_value(rng, f, safe=safe)]  # given twice
            if case is not None and f not in REPEATABLE:
                case["expect_refusal"] = True
        else:
            argv.append(f)  # no value (or the next flag taken as its value)
            if case is not None and rng.random() < 0.5:
                case["expect_refusal"] = True


def spec_source(rng, cat, big_ok=True):
    """Where the spec comes from; `big_ok` false (plan): the published families rarely (a plan
    of one takes seconds), configs mostly mutated or tiny."""
    r = rng.random()
    if r < 0.55:
        if not big_ok and rng.random() < 0.75:
            return ["--preset", rng.choice(DIT_PRESETS[:6])]  # DiT-S and DiT-B: a plan in ms
        return ["--preset", rng.choice(DIT_PRESETS)]
    if r < 0.7:
        if big_ok or rng.random() < 0.25:
            return ["--preset", rng.choice(FAMILY_PRESETS)]
        return ["--preset", rng.choice(DIT_PRESETS)]
    if r < 0.8:
        return ["--config", rng.choice(cat["spec"])]
    if r < 0.9:
        pool = cat["config"] + cat["model_dir"]
        if not big_ok:
            pool = [c for c in pool if "/m" in c.rsplit("configs", 1)[-1][:3] or "tiny" in c]
        return ["--model", rng.choice(pool)]
    if r < 0.93:
        return ["--preset", rng.choice(GENERIC_BAD + ["dit-s-3", "DiT-S/2", "flux", "dit-s-2 "])]
    if r < 0.96:
        return [rng.choice(["--config", "--model"]), special_in(rng)]
    if r < 0.98:
        return ["--preset", "dit-s-2", "--config", rng.choice(cat["spec"])]
    return []


def stdout_mode(rng):
    r = rng.random()
    if r < 0.80:
        return "file"
    if r < 0.85:
        return "null"
    if r < 0.90:
        return "full"
    if r < 0.97:
        return rng.choice(["closed0", "closed1", "closed100"])
    return "closedfd"


AS_LIMITS = [50_000_000, 80_000_000, 100_000_000, 200_000_000, 290_000_000, 300_000_000, 400_000_000,
             1_000_000_000]


def gen_case(i, seed, cat):
    rng = random.Random(f"{seed}:{i}")
    cmds, weights = zip(*COMMAND_WEIGHTS)
    cmd = rng.choices(cmds, weights)[0]
    case = {"id": i, "cmd": cmd, "argv": [], "stdout": stdout_mode(rng), "as": None, "timeout": 20,
            "setup": [], "outputs": [], "expect_refusal": False}
    argv = case["argv"]

    def out_flag(flag, ext):
        p, refused, setup = output_target(rng, ext)
        argv.extend([flag, p])
        case["setup"] += setup
        if not refused:
            case["outputs"].append(p)
        else:
            case["expect_refusal"] = True

    if cmd == "top":
        argv += rng.choice([[], ["--help"], ["-V"], ["--version"], ["help"], ["help", "estimate"], ["bogus"],
                            ["Estimate"], ["estimate", "--help"], ["--json"], ["😀"], ["help", "bogus"],
                            ["plan", "-h"], ["gpus", "--help", "--json"], ["oom"], ["--", "estimate"]])
        case["expect_refusal"] = argv in (["bogus"], ["Estimate"], ["😀"], ["--json"], ["oom"])
        case["cmd"] = argv[0] if argv and argv[0] in dict(COMMAND_WEIGHTS) else "top"
        return case
    argv.append(cmd)
    if cmd in ("estimate", "spec", "plan"):
        argv += spec_source(rng, cat, big_ok=cmd != "plan")
        if cmd == "plan":
            case["timeout"] = 40
            if rng.random() < 0.8:
                argv += ["--budget", pick_value(rng, "--budget")]
            heavy = any(a in FAMILY_PRESETS for a in argv) or "--model" in argv
            add_flags(rng, argv, SPEC_FLAGS + PLAN_FLAGS, rng.randint(0, 5 if not heavy else 3), case=case)
            if rng.random() < 0.2:
                out_flag("--out", ".toml")
            if rng.random() < 0.15:
                argv += ["--emit", pick_value(rng, "--emit")]
                if rng.random() < 0.6:
                    out_flag("--emit-out", ".yaml")
            if rng.random() < 0.1:
                out_flag("--plot", ".svg")
            if rng.random() < 0.05:
                argv += ["--profile", rng.choice(cat["profile"] + [special_in(rng)])]
        else:
            add_flags(rng, argv, SPEC_FLAGS, rng.randint(0, 6), case=case)
            if cmd == "estimate":
                for f in ("--inventory", "--timeline"):
                    if rng.random() < 0.15:
                        argv.append(f)
                if rng.random() < 0.15:
                    out_flag("--plot", ".svg")
        if rng.random() < 0.3:
            argv.append("--json")
        if rng.random() < 0.03:
            argv += [rng.choice(["--bogus", "-x", "positional", "--Preset", "--resolution-x"]), "1"]
            case["expect_refusal"] = True
    elif cmd == "params":
        r = rng.random()
        if r < 0.4:
            argv += ["--preset", rng.choice(FAMILY_PRESETS + DIT_PRESETS[:2] + ["bogus", ""])]
        elif r < 0.85:
            argv += ["--model", rng.choice(cat["config"] + cat["model_dir"])]
        elif r < 0.95:
            argv += ["--model", special_in(rng)]
        if rng.random() < 0.35:
            argv += ["--weights", rng.choice(cat["weights"]) if rng.random() < 0.85 else special_in(rng)]
        for f in ("--tensors", "--json"):
            if rng.random() < 0.3:
                argv.append(f)
    elif cmd == "gpus":
        if rng.random() < 0.5:
            argv.append(rng.choice(GPUS + ["bogus", "H200", "", "😀", "x" * 5000, "-1", "h200 "]))
        if rng.random() < 0.4:
            argv.append("--json")
        if rng.random() < 0.1:
            argv.append(rng.choice(GPUS))
    elif cmd == "agree":
        case["timeout"] = 90
        argv += ["--every", pick_value(rng, "--every", fault=rng.random() < 0.3)
                 if rng.random() < 0.95 else "100"]
        if argv[-1] in ("1", "2"):
            argv[-1] = "1000"
        if rng.random() < 0.7:
            argv += ["--family", pick_value(rng, "--family")]
        if rng.random() < 0.3:
            argv.append("--json")
    elif cmd == "compare" and rng.random() < 0.6:
        # Snapshot mode: nothing runs.
        argv += ["--snapshot", rng.choice(cat["pickle"]) if rng.random() < 0.9 else special_in(rng)]
        if rng.random() < 0.7:
            argv += spec_source(rng, cat, big_ok=True)
        add_flags(rng, argv, ["--runtime", "--gpu", "--alloc-conf", "--device", "--precision", "--batch",
                              "--resolution", "--recompute"], rng.randint(0, 3), case=case)
        if rng.random() < 0.15:
            out_flag("--plot", ".svg")
        if rng.random() < 0.3:
            argv.append("--json")
    else:
        # run / compare / verify on a tiny spec: most cases carry a fault that is refused before
        # any work; a few execute.
        case["timeout"] = {"run": 30, "compare": 30, "verify": 45}[cmd]
        execute = rng.random() < {"run": 0.03, "compare": 0.03, "verify": 0.03}[cmd]
        if rng.random() < 0.9:
            argv += ["--preset", rng.choice(["dit-s-2", "dit-s-4"]), "--resolution", "32", "--batch", "1"]
        else:
            argv += ["--model", rng.choice(cat["config"]), "--resolution", "32", "--batch", "1"]
        argv += ["--steps", "1"] if cmd != "verify" else ["--steps", rng.choice(["0", "1"])]
        if cmd == "verify":
            argv += ["--variants", rng.choice(POOLS["--variants"][0]), "--jobs", "1"]
        if cmd == "run":
            argv += ["--warmup", rng.choice(["0", "1"])]
        extra = {"run": ["--lr", "--seed", "--data-seed", "--warmup"],
                 "compare": [],
                 "verify": ["--lr", "--seed", "--data-seed", "--jobs"]}[cmd]
        safe_flags = ["--precision", "--optimizer", "--attention", "--recompute", "--ema", "--latents",
                      "--bf16-products", "--cpu-threads", "--lora-rank", "--runtime", "--depth"] + extra
        add_flags(rng, argv, safe_flags, rng.randint(0, 2), safe=True)
        if rng.random() < 0.3:
            argv.append("--json")
        if not execute:
            r = rng.random()
            if r < 0.45:
                f = rng.choice(safe_flags + ["--batch", "--resolution", "--steps"])
                argv += [f, pick_value(rng, f, safe=True, fault=True)]
                case["expect_refusal"] = True
            elif r < 0.7:
                outs = {"run": [("--out", ".json")], "compare": [("--plot", ".svg")],
                        "verify": [("--save-reference", ".safetensors"), ("--plot", ".svg")]}[cmd]
                f, ext = rng.choice(outs)
                p, refused, setup = output_target(rng, ext)
                if not refused:
                    p, refused, setup = ("{C}/missing/x" + ext, True, [])
                argv += [f, p]
                case["setup"] += setup
                case["expect_refusal"] = True
            elif r < 0.8:
                case["as"] = rng.choice(AS_LIMITS[:6])
            elif r < 0.9 and cmd == "run":
                argv += ["--latents-dir", rng.choice(cat["latents"] + [special_in(rng)])]
            elif cmd == "verify":
                argv += ["--reference", rng.choice(cat["weights"] + [special_in(rng)])]
            elif cmd == "compare":
                argv += ["--runtime", "pytorch", "--python", rng.choice(SPECIAL_IN + ["/bin/false", "/bin/true"])]
            else:
                argv += [rng.choice(["--config", "--model"]), special_in(rng)]
                case["expect_refusal"] = True
        else:
            if rng.random() < 0.3:
                outs = {"run": [("--out", ".json")], "compare": [("--plot", ".svg")],
                        "verify": [("--save-reference", ".safetensors"), ("--plot", ".svg")]}[cmd]
                f, ext = rng.choice(outs)
                argv += [f, "{C}/out" + ext]
                case["outputs"].append("{C}/out" + ext)
            if cmd == "run" and rng.random() < 0.3:
                argv += ["--latents-dir", rng.choice(["{F}/latents/ok_npy", "{F}/latents/ok_st",
                                                      "{F}/latents/ok_npy2"])]
            if rng.random() < 0.1:
                case["as"] = rng.choice(AS_LIMITS[5:])
        # Outputs of a failed write must not be judged as a run's own stdout failing early.
        if case["stdout"] in ("full", "closedfd") and not execute:
            case["stdout"] = "file"
    # A share of the address-space limits on every command.
    if case["as"] is None and rng.random() < 0.02:
        case["as"] = rng.choice(AS_LIMITS)
    return case


# ---------------------------------------------------------------------------------------------
# Running and classifying.


def subst(s, fix, cdir):
    return s.replace("{F}", fix).replace("{C}", cdir)


def snapshot_tree(root):
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            out[p] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def watch_base(fix):
    paths = set()
    for dirpath, dirnames, _ in os.walk(fix):
        paths.add(dirpath)
        for d in dirnames:
            paths.add(os.path.join(dirpath, d))
    sp = os.path.join(fix, "special")
    paths.update(os.path.join(sp, n) for n in os.listdir(sp))
    return paths


def watch_list(fix, case, base_set):
    """What a case could change among the fixtures: every folder (a created or removed entry
    changes its mtime), the special files (the output targets), and each fixture the case names
    (a folder named: its entries too; a checkpoint index: its folder's files)."""
    paths = set(base_set)
    for a in case["argv"]:
        if "{F}" not in a:
            continue
        p = subst(a, fix, "").rstrip("/")
        paths.add(p)
        base = p if os.path.isdir(p) else os.path.dirname(p)
        if os.path.isdir(p) or p.endswith(".index.json"):
            try:
                paths.update(os.path.join(base, n) for n in os.listdir(base))
            except OSError:
                pass
    return paths


def stat_paths(paths):
    out = {}
    for p in paths:
        try:
            st = os.lstat(p)
        except OSError:
            out[p] = None
            continue
        out[p] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def prepare_case_dir(cdir, case, fix):
    # The case folder is kept while it is empty but for tmp/ (file operations are slow on some
    # disks): cleared only when a case left something or sets something up.
    if (not case["setup"] and os.path.isdir(os.path.join(cdir, "tmp"))
            and os.listdir(cdir) == ["tmp"] and not os.listdir(os.path.join(cdir, "tmp"))):
        return
    if os.path.lexists(cdir):
        shutil.rmtree(cdir, ignore_errors=True)
        if os.path.lexists(cdir):
            subprocess.run(["chmod", "-R", "u+rwx", cdir], capture_output=True)
            shutil.rmtree(cdir, ignore_errors=True)
    os.makedirs(os.path.join(cdir, "tmp"))
    for kind, rel, arg in case["setup"]:
        p = os.path.join(cdir, rel)
        if kind == "file":
            with open(p, "w") as f:
                f.write(arg)
        elif kind == "link":
            os.symlink(subst(arg, fix, cdir), p)


def run_case(case, binary, fix, work, env_base):
    cdir = os.path.join(work, "case")
    prepare_case_dir(cdir, case, fix)
    before_case = snapshot_tree(cdir)
    argv = [binary] + [subst(a, fix, cdir) for a in case["argv"]]
    if case["as"]:
        argv = ["prlimit", f"--as={case['as']}", "--"] + argv
    env = dict(env_base, HOME=cdir, TMPDIR=os.path.join(cdir, "tmp"))
    errp = os.path.join(work, "stderr")
    outp = os.path.join(work, "stdout")
    err = open(errp, "wb")
    mode = case["stdout"]
    rfd = None
    preexec = None
    if mode == "file":
        out = open(outp, "wb")
    elif mode == "null":
        out = open("/dev/null", "wb")
    elif mode == "full":
        out = open("/dev/full", "wb")
    elif mode.startswith("closed") and mode != "closedfd":
        rfd, wfd = os.pipe()
        out = os.fdopen(wfd, "wb")
    else:
        out = open("/dev/null", "wb")
        preexec = lambda: os.close(1)  # noqa: E731
    t0 = time.monotonic()
    try:
        p = subprocess.Popen(argv, cwd=cdir, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                             start_new_session=True, preexec_fn=preexec)
    except (OSError, ValueError) as e:
        out.close()
        err.close()
        if rfd is not None:
            os.close(rfd)
        return {"error": f"could not start: {e}"}
    out.close()
    err.close()
    if rfd is not None:
        want = {"closed0": 0, "closed1": 1, "closed100": 100}[mode]
        got = 0
        while got < want and time.monotonic() - t0 < case["timeout"]:
            rd, _, _ = select.select([rfd], [], [], 0.05)
            if rd:
                chunk = os.read(rfd, want - got)
                if not chunk:
                    break
                got += len(chunk)
            elif p.poll() is not None:
                break
        os.close(rfd)
    hung = False
    # Woken by the child's exit (a pidfd), so that a case costs its own time only.
    try:
        pidfd = os.pidfd_open(p.pid)
    except (AttributeError, OSError):
        pidfd = None
    delay = 0.0002
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        left = case["timeout"] - (time.monotonic() - t0)
        if left <= 0:
            hung = True
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            pid, status, ru = os.wait4(p.pid, 0)
            break
        if pidfd is not None:
            select.select([pidfd], [], [], min(left, 1.0))
        else:
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
    if pidfd is not None:
        os.close(pidfd)
    p.returncode = 0  # reaped here
    wall = time.monotonic() - t0
    with open(errp, "rb") as f:
        stderr = f.read(65536).decode("utf-8", "replace")
    res = {"wall": round(wall, 4), "rss_kb": ru.ru_maxrss, "hung": hung}
    if os.WIFSIGNALED(status):
        res["signal"] = os.WTERMSIG(status)
        res["code"] = None
    else:
        res["code"] = os.WEXITSTATUS(status)
        res["signal"] = None
    res["stderr"] = stderr[:2000]
    after_case = snapshot_tree(cdir)
    owned = {os.path.normpath(subst(o, fix, cdir)) if o.startswith("{") else os.path.normpath(
        os.path.join(cdir, o)) for o in case["outputs"]}
    stray = []
    for path in sorted(set(after_case) - set(before_case)):
        if os.path.normpath(path) in owned or path == os.path.join(cdir, "tmp"):
            continue
        # A folder that holds an owned output (none are created: outputs sit in existing folders).
        stray.append(os.path.relpath(path, cdir))
    res["stray"] = stray[:10]
    return res


def classify(case, res, fix_changes):
    """All failure classes of one case, and its class in the table (the first failure, else the
    benign outcome)."""
    fails = []
    code, sig, err = res.get("code"), res.get("signal"), res.get("stderr", "")
    mode = case["stdout"]
    pipe_closed = mode.startswith("closed")
    if res.get("hung"):
        fails.append("hang")
    else:
        if code == 101 or "panicked at" in err:
            fails.append("panic")
        if sig == 6 or code == 134:
            fails.append("abort")
        if sig is not None and sig != 6 and not (sig == signal.SIGPIPE and pipe_closed):
            fails.append("signal")
        if code is not None and code not in EXIT_TABLE and code not in (101, 134):
            fails.append("bad_exit")
    if fix_changes:
        fails.append("files_changed")
    if res.get("stray"):
        fails.append("stray_file")
    write_failure = mode in ("full", "closed0", "closed1", "closed100", "closedfd")
    if code == 1 and not write_failure:
        fails.append("exit1_suspicious")
    if code not in (None, 0, 130) and not res.get("hung"):
        lines = [ln for ln in err.strip("\n").split("\n") if ln.strip()] if err.strip() else []
        if not (len(lines) == 1 or (len(lines) == 0 and write_failure)):
            fails.append("stderr_lines")
    if code == 0 and case.get("expect_refusal"):
        fails.append("accepted_invalid")
    if fails:
        cls = fails[0]
    elif sig == signal.SIGPIPE:
        cls = "sigpipe"
    elif code == 1:
        cls = "exit1_io"
    else:
        cls = f"exit{code}"
    return cls, fails


def shell_quote(a):
    if a and all(c.isalnum() or c in "-_./:=,+@%{}" for c in a):
        return a
    return "'" + a.replace("'", "'\\''") + "'"


def reproducer(case):
    parts = []
    if case["as"]:
        parts.append(f"prlimit --as={case['as']} --")
    parts.append("ditmem")
    parts += [shell_quote(a if len(a) <= 200 else a[:40] + f"…[{len(a)} chars]") for a in case["argv"]]
    s = " ".join(parts)
    s += {"file": "", "null": " > /dev/null", "full": " > /dev/full", "closed0": " | true",
          "closed1": " | head -c1", "closed100": " | head -c100", "closedfd": " >&-"}[case["stdout"]]
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", default=os.path.join(REPO, "target/release/ditmem"))
    ap.add_argument("--bin-label", default=None, help="what the binary is (its commit), for the summary")
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=50)
    ap.add_argument("--out", default=None, help="results folder (default runs/<UTC date>-<cpu>)")
    ap.add_argument("--work", default=None, help="sandbox (default a folder under /tmp)")
    ap.add_argument("--ids", default=None, help="run only these case ids (comma-separated): reproduce")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop (resumably) after this long")
    ap.add_argument("--summary-only", action="store_true", help="rewrite the summary from cases.jsonl")
    args = ap.parse_args()
    binary = os.path.abspath(args.bin)
    out = args.out or os.path.join(
        HERE, "runs", datetime.datetime.utcnow().strftime("%Y-%m-%d") + "-" + platform.machine() + "-" + (args.bin_label or "bin")
    )
    os.makedirs(out, exist_ok=True)
    cases_path = os.path.join(out, "cases.jsonl")
    if args.summary_only:
        write_summary(out, cases_path, binary, args)
        return
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "/tmp"
    work = args.work or f"{shm}/ditmem-fuzz-{args.seed}-{os.getpid()}"
    fix = os.path.join(work, "fix")
    os.makedirs(work, exist_ok=True)
    cat = build_fixtures(fix, binary, args.seed)
    done = set()
    if os.path.exists(cases_path) and not args.ids:
        with open(cases_path) as f:
            for line in f:
                try:
                    done.add(json.loads(line)["id"])
                except (ValueError, KeyError):
                    pass
    ids = [int(x) for x in args.ids.split(",")] if args.ids else [i for i in range(args.cases) if i not in done]
    env_base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    if args.jobs > 1:
        print("note: --jobs > 1 runs cases in threads, each in its own sandbox", file=sys.stderr)
    import threading
    lock = threading.Lock()
    fix_state = [snapshot_tree(fix)]
    sink = open(cases_path, "a") if not args.ids else None
    t_start = time.monotonic()
    counter = [0]
    counter_full = [0]
    stop = [False]
    base_set = watch_base(fix)

    def watch_list_cached(case):
        return watch_list(fix, case, base_set)

    def worker(k, my_ids):
        wdir = os.path.join(work, f"w{k}")
        os.makedirs(wdir, exist_ok=True)
        for i in my_ids:
            if stop[0]:
                return
            if args.max_seconds and time.monotonic() - t_start > args.max_seconds:
                stop[0] = True
                return
            case = gen_case(i, args.seed, cat)
            watch = watch_list_cached(case)
            before = stat_paths(watch)
            res = run_case(case, binary, fix, wdir, env_base)
            with lock:
                after = stat_paths(watch)
                changes = sorted(p for p in watch if after.get(p) != before.get(p))
                counter_full[0] += 1
                if not changes and counter_full[0] % 1000 == 0:
                    # The backstop: the whole tree against its state at the start.
                    full = snapshot_tree(fix)
                    changes = sorted(p for p in set(full) | set(fix_state[0])
                                     if full.get(p) != fix_state[0].get(p))
                    if changes:
                        res["fix_note"] = "found by the full check every 1000 cases: any case since"
                if changes:
                    # Recorded below; the fixtures are rebuilt for the next cases.
                    build_fixtures(fix, binary, args.seed)
                    fix_state[0] = snapshot_tree(fix)
                cls, fails = classify(case, res, changes)
                rec = dict(case, **res, cls=cls, fails=fails,
                           fix_changes=[os.path.relpath(c, fix) for c in changes][:10], repro=reproducer(case))
                if sink:
                    sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    sink.flush()
                else:
                    print(json.dumps(rec, ensure_ascii=False, indent=1))
                counter[0] += 1
                if counter[0] % 500 == 0:
                    el = time.monotonic() - t_start
                    print(f"{counter[0]} cases, {el:.0f} s, {counter[0] / el:.1f} cases/s", file=sys.stderr)

    threads = []
    if args.jobs == 1:
        worker(0, ids)
    for k in range(args.jobs if args.jobs > 1 else 0):
        t = threading.Thread(target=worker, args=(k, ids[k:: args.jobs]))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    if sink:
        sink.close()
        write_summary(out, cases_path, binary, args, run_seconds=time.monotonic() - t_start, run_cases=counter[0])


def write_summary(out, cases_path, binary, args, run_seconds=None, run_cases=None):
    recs = []
    with open(cases_path) as f:
        for line in f:
            try:
                recs.append(json.loads(line))
            except ValueError:
                pass
    table = {}
    shortest = {}
    wall_total = 0.0
    for r in recs:
        cmd = r["cmd"]
        table.setdefault(cmd, {})
        table[cmd][r["cls"]] = table[cmd].get(r["cls"], 0) + 1
        wall_total += r.get("wall", 0)
        for fcls in r.get("fails", []):
            key = f"{cmd}/{fcls}"
            if key not in shortest or len(r["repro"]) < len(shortest[key]["repro"]):
                shortest[key] = {"id": r["id"], "repro": r["repro"], "code": r.get("code"),
                                 "signal": r.get("signal"), "stderr": r.get("stderr", "")[:400],
                                 "setup": r.get("setup"), "fix_changes": r.get("fix_changes"),
                                 "stray": r.get("stray")}
    fail_counts = {}
    for r in recs:
        for fcls in r.get("fails", []):
            fail_counts[fcls] = fail_counts.get(fcls, 0) + 1
    commit = ""
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    prev = {}
    sp = os.path.join(out, "summary.json")
    if os.path.exists(sp):
        try:
            prev = json.load(open(sp))
        except ValueError:
            prev = {}
    runs = prev.get("runs", [])
    if run_seconds is not None:
        runs.append({"cases": run_cases, "seconds": round(run_seconds, 1),
                     "cases_per_second": round(run_cases / run_seconds, 2) if run_seconds else None,
                     "jobs": args.jobs, "ended": datetime.datetime.utcnow().isoformat(timespec="seconds") + "Z"})
    summary = {
        "binary": binary,
        "binary_label": args.bin_label or prev.get("binary_label"),
        "binary_size": os.path.getsize(binary) if os.path.exists(binary) else None,
        "repo_commit": commit,
        "seed": args.seed,
        "cases": len(recs),
        "classes_by_command": table,
        "failures_by_class": fail_counts,
        "shortest_reproducer": shortest,
        "sum_of_case_wall_seconds": round(wall_total, 1),
        "runs": runs,
    }
    with open(sp, "w") as f:
        json.dump(summary, f, indent=1, ensure_ascii=False)
    # Every failing case (cases.jsonl itself stays out of git: the seed regenerates it).
    with open(os.path.join(out, "failures.jsonl"), "w") as f:
        for r in recs:
            if r.get("fails"):
                f.write(json.dumps({k: r.get(k) for k in (
                    "id", "cmd", "fails", "code", "signal", "wall", "repro", "setup", "stdout", "as",
                    "fix_changes", "stray")} | {"stderr": r.get("stderr", "")[:300]}, ensure_ascii=False) + "\n")
    classes = [c for c in FAILURES + BENIGN if any(c in t for t in table.values())]
    lines = [f"# ditmem CLI fuzz campaign: {len(recs)} cases", "",
             f"binary `{binary}` ({summary['binary_label'] or 'no label'}), harness at `{commit}`, "
             f"seed {args.seed}", ""]
    for run in runs:
        lines.append(f"- run: {run['cases']} cases in {run['seconds']} s "
                     f"({run['cases_per_second']} cases/s, --jobs {run['jobs']}), ended {run['ended']}")
    lines += ["", "Failure classes first (**bold**: a failure); the rest are documented outcomes.", "",
              "| command | cases | " + " | ".join(f"**{c}**" if c in FAILURES else c for c in classes) + " |",
              "|---|---:|" + "---:|" * len(classes)]
    for cmd in sorted(table):
        row = table[cmd]
        lines.append(f"| {cmd} | {sum(row.values())} | " + " | ".join(str(row.get(c, "")) for c in classes) + " |")
    tot = {c: sum(t.get(c, 0) for t in table.values()) for c in classes}
    lines.append(f"| **all** | {len(recs)} | " + " | ".join(str(tot[c]) for c in classes) + " |")
    lines += ["", "Cases with each failure (a case may have several): " +
              (", ".join(f"{k} {v}" for k, v in sorted(fail_counts.items())) or "none"), "",
              "## Shortest reproducer per (command, failure)", "",
              "`{F}` is the fixture folder and `{C}` the case folder (`campaign.py --ids ID` rebuilds both "
              "and reruns the case).", ""]
    for key in sorted(shortest):
        s = shortest[key]
        first = (s["stderr"].strip().splitlines() or [""])[0][:200]
        lines.append(f"- **{key}** (case {s['id']}, exit {s['code']}, signal {s['signal']}): `{s['repro']}`"
                     + (f" — stderr: `{first}`" if first else "")
                     + (f" — changed: {s['fix_changes']}" if s.get("fix_changes") else "")
                     + (f" — left: {s['stray']}" if s.get("stray") else ""))
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:40 + len(table)]))


if __name__ == "__main__":
    main()
