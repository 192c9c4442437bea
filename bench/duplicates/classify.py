#!/usr/bin/env python3
"""Sort the rows of the `duplicates` tool (the tool library's command; it is not part of this
repository) into what they are, so that a count can be read: a row is a pair of places sharing
six or more lines of the same shape, and many such pairs are not repeated logic.

usage: classify.py ROOT OUT_DIR LIST...
  ROOT     the checkout the lists were made in
  OUT_DIR  where `rows.tsv` (one row per pair: category, both places, the tool's remarks) and
           `summary.md` (the count per category and the rows of each) are written
  LIST     outputs of `duplicates --most 200`, the first over the whole tree, the others with
           `--repo <folder>`, each file named `<folder with / as _>.txt` (`tree.txt` for the
           whole tree): `--most` caps a list at 200 rows, so the rows past it come from the
           per-folder lists.

Categories, from the lines of the pair's first place (comments and blank lines dropped):
  run record      both places under a dated `bench/*/runs/` folder: raw outputs of a run
  signature       a function signature laid out one parameter per line (rustfmt past 100
                  columns): 60 % or more of the lines are parameters, `) -> …`, `fn …(`, `where`
                  bounds, and one of them opens or closes a signature
  field list      a struct definition or literal: 75 % or more of the lines are `name: value,`
                  fields, closing brackets, attributes or a `Name {` opener
  other           the rest, listed whole in summary.md to be read one by one
"""
import collections
import os
import re
import sys

PARAM = re.compile(
    r"^\s*(\(?[\w, ]+\)?|_?\w+): [^=]+,$"  # `name: Type,` / `(a, b): (T, U),`
    r"|^\s*\)( -> .*)?( \{| where)?$"  # `) -> R {`
    r"|^\s*(pub(\([a-z]+\))?\s+)?(unsafe\s+)?fn \w+.*[(<]$"  # `fn name(`
    r"|^\s*(where|\{|\}|impl .*\{|#\[.*\]|mod \w+ \{)$"
)
SIGNATURE_EDGE = re.compile(r"^\s*\)( -> .*)?( \{| where)?$|^\s*(pub(\([a-z]+\))?\s+)?(unsafe\s+)?fn ")
FIELD = re.compile(
    r"^\s*(pub(\([a-z]+\))?\s+)?[A-Za-z_]\w*(:\s*[^;{}]+)?,\s*$"  # `pub name: Type,` / `name,`
    r"|^\s*[}\])]+[,;]?\s*$"  # closers
    r"|^\s*(pub(\([a-z]+\))?\s+)?(struct|enum) \w+"
    r"|^\s*#\["
    r"|^\s*(\w+|\w+::\w+|Self|let \w+ = \w+) \{$"
)
ROW = re.compile(r"D\d+ (\S+):(\d+)-(\d+) ~ (\S+):(\d+)-(\d+)(.*)")


def rows(lists):
    found = {}
    for path in lists:
        base = os.path.basename(path)[: -len(".txt")]
        prefix = "" if base == "tree" else base.replace("_", "/", 1)
        for line in open(path, encoding="utf-8"):
            m = ROW.match(line)
            if not m:
                continue
            a, a0, a1, b, b0, b1, rest = m.groups()
            if prefix:
                a, b = f"{prefix}/{a}", f"{prefix}/{b}"
            key = tuple(sorted([a, b]))
            found.setdefault(key, (a, int(a0), int(a1), b, int(b0), int(b1), rest.strip()))
    return sorted(found.values())


def category(root, a, a0, a1, b):
    if "/runs/" in a and "/runs/" in b:
        return "run record"
    text = open(os.path.join(root, a), encoding="utf-8").read().splitlines()[a0 - 1 : a1]
    lines = [x for x in text if x.strip() and not x.strip().startswith(("//", "#!", "# "))]
    n = max(len(lines), 1)
    if sum(bool(PARAM.match(x)) for x in lines) >= 0.6 * n and any(SIGNATURE_EDGE.match(x) for x in lines):
        return "signature"
    if sum(bool(FIELD.match(x)) for x in lines) >= 0.75 * n:
        return "field list"
    return "other"


def main():
    root, out, lists = sys.argv[1], sys.argv[2], sys.argv[3:]
    os.makedirs(out, exist_ok=True)
    by = collections.defaultdict(list)
    for a, a0, a1, b, b0, b1, rest in rows(lists):
        by[category(root, a, a0, a1, b)].append(f"{a}:{a0}-{a1}\t{b}:{b0}-{b1}\t{rest}")
    order = ["field list", "signature", "run record", "other"]
    with open(os.path.join(out, "rows.tsv"), "w", encoding="utf-8") as f:
        for c in order:
            for r in by[c]:
                f.write(f"{c}\t{r}\n")
    total = sum(len(v) for v in by.values())
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(f"# `duplicates` rows by kind\n\n{total} pairs.\n\n| kind | pairs |\n|---|---:|\n")
        for c in order:
            f.write(f"| {c} | {len(by[c])} |\n")
        for c in order:
            f.write(f"\n## {c}\n\n")
            for r in by[c]:
                a, b, rest = r.split("\t")
                f.write(f"- `{a}` ~ `{b}` {rest}\n")
    print(f"{total} pairs: " + ", ".join(f"{c} {len(by[c])}" for c in order))


if __name__ == "__main__":
    main()
