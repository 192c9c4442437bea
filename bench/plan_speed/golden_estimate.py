#!/usr/bin/env python3
"""Write crates/cli/tests/data/plan_speed/estimate_golden.json: what `ditmem estimate --json`
answers beyond the budget (`ESTIMATE_KEYS`: what has to fit, whether it does, the CUDA report and
every lever row) for `ESTIMATE_QUERIES`, so that a faster lever ranking can be held to the same
answers. usage: golden_estimate.py BINARY (the committed file: the release binary of 8dcd2a5,
before the levers were memoised, issue 46 part 4 / h-speed3; the allocation-event counts of
every row and three FLUX.1/SD3.5 rows rewritten by the merged binary after issue 49's rules)."""
import json
import subprocess
import sys

from golden_queries import ESTIMATE_QUERIES, ESTIMATE_KEYS

binary = sys.argv[1]
out = {}
for q in ESTIMATE_QUERIES:
    p = subprocess.run([binary, "estimate", "--json"] + q.split(), stdout=subprocess.PIPE, text=True)
    got = json.loads(p.stdout)
    out[q] = {"exit": p.returncode, **{k: got.get(k) for k in ESTIMATE_KEYS}}
json.dump(out, open("crates/cli/tests/data/plan_speed/estimate_golden.json", "w"), indent=1,
          sort_keys=True)
print(f"{len(out)} estimates")
