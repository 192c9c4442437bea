"""Compare two `ditmem agree --family all` outputs row by row (predicted, measured, error)."""
import re
import statistics
import sys

ROW = re.compile(r"^\s+(.+?)\s{2,}([\d,]+)\s+([\d,]+)\s+([+-][\d.]+) %$")


def rows(path):
    out = {}
    section = ""
    for line in open(path):
        m = ROW.match(line.rstrip("\n"))
        if m:
            key = (section, m.group(1).strip())
            out[key] = (int(m.group(2).replace(",", "")), int(m.group(3).replace(",", "")), float(m.group(4)))
        elif line.strip() and not line.startswith(" "):
            section = line.strip()
    return out


a, b = rows(sys.argv[1]), rows(sys.argv[2])
common = [k for k in a if k in b]
moved_p = [k for k in common if a[k][0] != b[k][0]]
moved_m = [k for k in common if a[k][1] != b[k][1]]
both = [k for k in common if a[k][0] != b[k][0] and a[k][1] != b[k][1]]
print(f"rows: {len(a)} / {len(b)}, common {len(common)}")
print(f"prediction moved: {len(moved_p)}, measurement moved: {len(moved_m)}, both: {len(both)}")
for name, d in (("before", a), ("after", b)):
    errs = [abs(d[k][2]) for k in common]
    print(f"{name}: max |error| {max(errs):.3f} %, median {statistics.median(errs):.3f} %")
for k in moved_p + [k for k in moved_m if k not in moved_p]:
    dp, dm = b[k][0] - a[k][0], b[k][1] - a[k][1]
    print(f"  {k[1][:60]:60} predicted {dp:+,} B, measured {dm:+,} B, error {a[k][2]:+.3f} → {b[k][2]:+.3f} %")
