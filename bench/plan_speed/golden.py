#!/usr/bin/env python3
"""Write crates/cli/tests/data/plan_speed/golden.json: the plans (and their figures) a ditmem
binary gives for the queries of crates/cli/tests/plan_speed_cli.rs, so that a faster search can be
held to the same answers. usage: golden.py BINARY (the binary whose answers are the reference;
the committed file came from the base commit 95ad019's release binary, its search before the
speed-up; the FLUX.1-dev row was rewritten on 2026-12-06 by the merged binary after an intended
change of the model — the Flux scripts' resident VAE decoder and fp32 VAE, issue 46 — so that row
pins the merged search, not 95ad019's; rewritten again the same day after bitsandbytes' 8-bit
AdamW lost its invented state-sized scratch (h-sd3case): the same plan, its 8-bit points lower); the FLUX.1-dev and SD3.5-medium rows rewritten once more
after issue 49's rules (SD3/Flux block locals held to the block's end, the single block's
concatenation and its gradient views: the Flux plan's peak +21 MB, SD3.5's Pareto points); the
FLUX.1-dev row rewritten on 2026-12-07 after the planner tried an NF4 base without 8-bit AdamW
before both (8-bit AdamW had been taken for a 0.6 % faster step: now recompute 23/57, LoRA, NF4,
expandable segments, 2.42 s)."""
import json
import subprocess
import sys

from golden_queries import QUERIES, figures

binary = sys.argv[1]
out = {}
for q in QUERIES:
    p = subprocess.run([binary, "plan", "--json", "--time-limit", "600"] + q.split(),
                       stdout=subprocess.PIPE, text=True)
    out[q] = {"exit": p.returncode, **figures(json.loads(p.stdout))}
json.dump(out, open("crates/cli/tests/data/plan_speed/golden.json", "w"), indent=1, sort_keys=True)
print(f"{len(out)} plans")
