#!/usr/bin/env python3
"""Compare two `ditmem agree --family all --json` outputs spec by spec: the predicted and the
measured step peak (and each phase's), which moved, by how much, and the agreement before and
after. Usage: compare.py BEFORE.json AFTER.json"""
import json
import statistics
import sys

a = {s['name']: s for s in json.load(open(sys.argv[1]))['specs']}
b = {s['name']: s for s in json.load(open(sys.argv[2]))['specs']}
both = moved_p = moved_m = 0
rows = []
for k in sorted(a.keys() & b.keys()):
    x, y = a[k], b[k]
    dp = y['predicted_peak_bytes'] - x['predicted_peak_bytes']
    dm = y['measured_peak_bytes'] - x['measured_peak_bytes']
    if dp or dm:
        rows.append((k, dp, dm, x['rel_error'], y['rel_error']))
        both += bool(dp and dm)
        moved_p += bool(dp and not dm)
        moved_m += bool(dm and not dp)
print(f"specs: {len(a)} before, {len(b)} after, {len(a.keys() & b.keys())} in both")
print(f"peaks moved: {len(rows)} rows; both predicted and measured {both}, predicted only {moved_p}, "
      f"measured only {moved_m}")
for k, dp, dm, ex, ey in rows:
    print(f"  {k:70s} predicted {dp:+10,d} B  measured {dm:+10,d} B  "
          f"differ {dm - dp:+8,d} B  error {100 * ex:+.3f} % -> {100 * ey:+.3f} %")
for name, d in (('before', a), ('after', b)):
    e = [abs(s['rel_error']) for s in d.values()]
    print(f"{name}: max |error| {100 * max(e):.3f} %, median {100 * statistics.median(e):.3f} %")
