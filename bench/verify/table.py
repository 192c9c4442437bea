#!/usr/bin/env python3
"""The real-width table of a bench/verify run folder: for each preset, verify's variants
(pass / warn / fail), the largest margins, time and RSS (GNU time), and compare's error.

Usage: table.py RUN_FOLDER  (reads verify-*.json, verify-*.time, compare-*.json, compare-*.time)
"""
import glob
import json
import os
import re
import sys


def gnu_time(path):
    text = open(path).read() if os.path.exists(path) else ""
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    rc = re.search(r"(?:rc=|Exit status: )(\d+)", text)
    return (wall.group(1) if wall else "-",
            int(rss.group(1)) / 1024 if rss else None,
            int(rc.group(1)) if rc else None)


def main(folder):
    rows = []
    for vf in sorted(glob.glob(os.path.join(folder, "verify-*.json"))):
        tag = os.path.basename(vf)[len("verify-"):-len(".json")]
        wall, rss, rc = gnu_time(vf[:-5] + ".time")
        try:
            v = json.load(open(vf))
        except ValueError:
            rows.append(f"| {tag} | verify exit {rc} (no report) | | | | | | | |")
            continue
        m = lambda k: max((x.get(k) or 0.0) for x in v["variants"])
        spec = v["reference_spec"]
        depth = spec["model"].get("keep_blocks") or [spec["model"]["depth"]]
        res = f'{spec["workload"]["height"]}×{spec["workload"]["width"]}'
        cmp_err = "-"
        cf = os.path.join(folder, f"compare-{tag}.json")
        if os.path.exists(cf):
            try:
                c = json.load(open(cf))
                cmp_err = f'{100 * c["rel_error"]:+.3f} % ({c["measured_peak_bytes"] / 2**20:.1f} MiB)'
            except ValueError:
                cmp_err = f"exit {gnu_time(cf[:-5] + '.time')[2]}"
        mem = v.get("memory", {})
        predicted = f'{mem["peak"] / 2**20:.0f} MiB' if "peak" in mem else "-"
        rows.append(
            f'| {re.sub(r"-d[0-9,]+-r[0-9]+$", "", tag)} | {",".join(map(str, depth))} | {res} | hidden {spec["model"]["hidden"]} '
            f'| {v["passed"]} / {v["warned"]} / {v["failed"]} | {m("grad_margin"):.3f} / {m("loss_margin"):.3f} / '
            f'{m("drift_margin"):.3f} | {wall} | {rss:.0f} MiB | {predicted} | {cmp_err} |'
        )
    print("| preset | depth | resolution | width | pass / warn / fail | largest margin grad / loss / drift "
          "| verify wall | verify max RSS | verify predicted peak | compare peak error (measured) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    # compare alone (no verify in the folder for that tag)
    alone = []
    for cf in sorted(glob.glob(os.path.join(folder, "compare-*.json"))):
        tag = os.path.basename(cf)[len("compare-"):-len(".json")]
        if os.path.exists(os.path.join(folder, f"verify-{tag}.json")):
            continue
        wall, rss, rc = gnu_time(cf[:-5] + ".time")
        try:
            c = json.load(open(cf))
            err = f'{100 * c["rel_error"]:+.3f} % ({c["measured_peak_bytes"] / 2**20:.1f} MiB measured, {c["predicted_peak_bytes"] / 2**20:.1f} MiB predicted)' \
                if "predicted_peak_bytes" in c else f'{100 * c["rel_error"]:+.3f} % ({c["measured_peak_bytes"] / 2**20:.1f} MiB)'
        except ValueError:
            err = f"exit {rc}"
        alone.append(f"| {tag} | {err} | {wall} | {rss:.0f} MiB |" if rss else f"| {tag} | {err} | {wall} | - |")
    if alone:
        print("\n| compare alone | peak error | wall | max RSS |\n|---|---|---|---|")
        print("\n".join(alone))


if __name__ == "__main__":
    main(sys.argv[1])
