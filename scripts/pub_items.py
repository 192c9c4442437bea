#!/usr/bin/env python3
"""Public items of a library crate that no other crate uses.

Usage: scripts/pub_items.py [--apply] [--exclude PATH ...]

For `crates/budget` and `crates/engine`: every line `pub fn|struct|enum|const|static|trait|
type|union NAME` of `src/` (fields, `pub use` and `pub mod` are not counted) is a public item; it
is *used by another crate* when NAME occurs as a word in a file of another crate of the
workspace (`crates/*/src`, `tests`, `benches` of the others, and the crate's own `tests/` and
`benches/`, which are crates of their own), or is named by a `pub use` of its own crate (a
re-export keeps it public on purpose). The rest are printed (file:line name) and counted; with
`--apply`, their `pub` becomes `pub(crate)` except in the excluded files. A name match is
conservative: a method called `new` elsewhere keeps every `pub fn new`.
"""
import re, sys, pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
ITEM = re.compile(r'^(\s*)pub (?:const )?(?:unsafe )?(?:async )?(fn|struct|enum|const|static|trait|type|union)\s+([A-Za-z_][A-Za-z0-9_]*)')

def words(path):
    try:
        return set(re.findall(r'[A-Za-z_][A-Za-z0-9_]*', path.read_text()))
    except Exception:
        return set()

def main():
    apply = '--apply' in sys.argv
    excl = [a for a in sys.argv[1:] if not a.startswith('--')]
    crates = sorted(p for p in (ROOT / 'crates').iterdir() if (p / 'Cargo.toml').exists())
    total_before = total_left = 0
    for lib in ('budget', 'engine'):
        c = ROOT / 'crates' / lib
        outside = set()
        for o in crates:
            dirs = ['tests', 'benches'] if o == c else ['src', 'tests', 'benches']
            for d in dirs:
                for f in (o / d).rglob('*.rs'):
                    outside |= words(f)
        reexported = set()
        for f in (c / 'src').rglob('*.rs'):
            for m in re.finditer(r'pub use [^;]*;', f.read_text()):
                reexported |= set(re.findall(r'[A-Za-z_][A-Za-z0-9_]*', m.group(0)))
        n = unused = changed = 0
        for f in sorted((c / 'src').rglob('*.rs')):
            rel = f.relative_to(ROOT).as_posix()
            lines = f.read_text().split('\n')
            hit = False
            for i, line in enumerate(lines):
                m = ITEM.match(line)
                if not m:
                    continue
                n += 1
                name = m.group(3)
                if name in outside or name in reexported:
                    continue
                unused += 1
                skip = any(rel.startswith(e) for e in excl)
                print(f"{rel}:{i+1} {m.group(2)} {name}{' (excluded file)' if skip else ''}")
                if apply and not skip:
                    lines[i] = line.replace('pub ', 'pub(crate) ', 1)
                    hit = True
                    changed += 1
            if hit:
                f.write_text('\n'.join(lines))
        print(f"# {lib}: {n} pub items, {unused} used by no other crate, {changed} made pub(crate)")
        total_before += n
        total_left += n - changed

main()
