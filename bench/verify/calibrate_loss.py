#!/usr/bin/env python3
"""The loss factor κ_ℓ measured on correct runs at real width (issue 51).

For each variant of each verify JSON given (or found under the folders given), c_ℓ = the loss's
relative error / (u_c · √P_f), with u_c and P_f read from the JSON itself (`tolerances`,
`growth.forward_chain`), as `verify::Tolerance` fits it; κ_ℓ = SPREAD_MARGIN (2) × the largest
c_ℓ per precision, rounded up to two significant digits. Also prints the largest gradient and
drift margins per precision (error / tolerance; the calibration keeps them ≤ 0.5 at its points).

With --now, also each file's largest loss margin judged with KAPPA_LOSS_NOW (the κ_ℓ of
`crates/conformance/src/verify/mod.rs` `kappa` after this calibration), for runs made before it.

Usage: calibrate_loss.py [--now] PATH...   (verify-*.json files or run folders)
"""
import glob
import json
import math
import os
import sys


# κ_ℓ per policy in `verify::kappa` since the real-width calibration (issue 51).
KAPPA_LOSS_NOW = {"fp64": 1.8, "fp32": 1.2, "bf16-mixed": 0.054, "fp16-mixed": 0.098, "bf16-pure": 0.049}


def files(paths):
    for p in paths:
        if os.path.isdir(p):
            yield from sorted(glob.glob(os.path.join(p, "verify-*.json")))
        else:
            yield p


def round_up_2(x):
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x)) - 1
    return math.ceil(x / 10**e - 1e-9) * 10**e


def main(paths):
    now = "--now" in paths
    paths = [p for p in paths if p != "--now"]
    best = {}
    for f in files(paths):
        try:
            v = json.load(open(f))
        except ValueError:
            continue
        u = {t["precision"]: t["unit_roundoff"] for t in v["tolerances"]}
        pf = v["growth"]["forward_chain"]
        tag = f"{os.path.basename(os.path.dirname(f))}/{os.path.basename(f)}"
        if now:
            worst = max(
                (x["loss_rel_err"] / (u[x["precision"]] * KAPPA_LOSS_NOW[x["precision"]] * math.sqrt(pf)), x["name"])
                for x in v["variants"] if x.get("loss_rel_err") is not None
            )
            print(f"{tag}: largest loss margin at today's kappa_l {worst[0]:.3f} ({worst[1]})")
        for x in v["variants"]:
            p = x["precision"]
            if x.get("loss_rel_err") is None:
                continue
            c = x["loss_rel_err"] / (u[p] * math.sqrt(pf))
            b = best.setdefault(p, {"c": (-1, ""), "grad": (-1, ""), "drift": (-1, "")})
            src = f"{tag} {x['name']}"
            if c > b["c"][0]:
                b["c"] = (c, src)
            for k, m in (("grad", x.get("grad_margin")), ("drift", x.get("drift_margin"))):
                if m is not None and m > b[k][0]:
                    b[k] = (m, src)
    for p, b in best.items():
        c, src = b["c"]
        print(f"{p:11s} c_l max {c:.4g} -> kappa_l = 2 x c = {round_up_2(2 * c):.3g}   ({src})")
        print(f"{'':11s} grad margin max {b['grad'][0]:.3f} ({b['grad'][1]}); drift margin max {b['drift'][0]:.3f} ({b['drift'][1]})")


if __name__ == "__main__":
    main(sys.argv[1:])
