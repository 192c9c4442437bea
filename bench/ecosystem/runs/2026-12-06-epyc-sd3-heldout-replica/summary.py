"""The replica's table: per microbatch (accelerate `accumulate` block) the live bytes at its start,
the peak inside it, the peak above the start, and the owners at its start (e2e_hook's census;
models of one class are summed)."""
import json
import sys

m = json.load(open(sys.argv[1]))
print("| microbatch | epoch | live at start (B) | peak (B) | peak − start (B) | text encoders at start (B) | transformer grads at start (B) | optimizer state (B) |")
print("|---|---|---|---|---|---|---|---|")
for k, s in enumerate(m["steps"]):
    own = {}
    for o in s["owners_at_start"]:
        own[o["owner"]] = own.get(o["owner"], 0) + o["bytes"]
    te = sum(v for n, v in own.items() if n.startswith(("CLIPText", "T5Encoder")))
    print(f"| {k} | {k // 8} | {s['start']:,} | {s['peak']:,} | {s['peak'] - s['start']:,} | {te:,} | "
          f"{own.get('SD3Transformer2DModel base grads', 0):,} | {own.get('AdamW state', 0):,} |")
print(f"\nrun peak {m['run_peak']:,} B; torch {m['torch']}, {m['threads']} threads")
