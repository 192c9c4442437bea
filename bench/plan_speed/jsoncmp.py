#!/usr/bin/env python3
"""--json of the 28 plan_speed queries (run.py's QUERIES) from two binaries, compared byte for byte after dropping
search_ms and evaluated (plans only). usage: jsoncmp.py BASE NEW OUTFILE"""
import json, re, subprocess, sys
sys.path.insert(0, "bench/plan_speed")
from run import QUERIES
base, new, out = sys.argv[1:4]
def get(b, cmd, args):
    extra = ["--time-limit", "600"] if cmd == "plan" else []
    p = subprocess.run([b, cmd] + args.split() + extra + ["--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p.returncode, p.stdout
def strip(text):
    # drop the two fields wherever they appear (top level and nested), keep everything else as printed
    return re.sub(r'\n\s*"(search_ms|evaluated)": [^,\n]*,?', '', text)
lines = []
bad = 0
for name, cmd, args in QUERIES:
    rb, ob = get(base, cmd, args)
    rn, on = get(new, cmd, args)
    same_raw = ob == on
    same = rb == rn and strip(ob) == strip(on)
    bad += not same
    lines.append(f"{'same' if same else 'DIFFERENT'} {name} (exit {rb}/{rn}; raw json {'identical' if same_raw else 'differs only in search_ms/evaluated' if same else 'differs'}; {len(on)} bytes)")
lines.append(f"{len(QUERIES) - bad} of {len(QUERIES)} identical (less search_ms/evaluated)")
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
