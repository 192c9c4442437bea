#!/usr/bin/env python3
"""Sizes that say whether a newcomer can read the code: files over 1,000 lines and functions over
100 lines (from the `fn` line to its closing brace) in every crate's `src/`.

Usage: scripts/house_sizes.py [ROOT] [--list]
A function's end is found by counting braces with comments, strings and char literals blanked,
so it is a measure, not a parser; test modules count as they stand.
"""
import re, sys, pathlib

FN = re.compile(r'^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?(?:extern\s+"[^"]*"\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)')

def blank(text):
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith('//', i):
            j = text.find('\n', i)
            j = n if j < 0 else j
            i = j
        elif text.startswith('/*', i):
            j = text.find('*/', i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r'[^\n]', ' ', text[i:j])); i = j
        elif c == '"' or (c == 'r' and re.match(r'r#*"', text[i:i+3]) and (i == 0 or not (text[i-1].isalnum() or text[i-1] == '_'))):
            m = re.match(r'r(#*)"', text[i:]) if c == 'r' else None
            if m:
                end = '"' + m.group(1); j = text.find(end, i + len(m.group(0)))
                j = n if j < 0 else j + len(end)
            else:
                j = i + 1
                while j < n and text[j] != '"':
                    j += 2 if text[j] == '\\' else 1
                j += 1
            out.append(re.sub(r'[^\n]', ' ', text[i:j])); i = j
        elif c == "'" and re.match(r"'(\\.[^']*|[^\\'])'", text[i:]):
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:]); out.append(' ' * len(m.group(0))); i += len(m.group(0))
        else:
            out.append(c); i += 1
    return ''.join(out)

def functions(path):
    text = blank(path.read_text())
    lines = text.split('\n')
    res = []
    for k, line in enumerate(lines):
        m = FN.match(line)
        if not m:
            continue
        depth, started = 0, False
        for e in range(k, len(lines)):
            for ch in lines[e]:
                if ch == '{':
                    depth += 1; started = True
                elif ch == '}':
                    depth -= 1
                elif ch == ';' and not started and depth == 0:
                    break
            else:
                if started and depth == 0:
                    res.append((m.group(1), k + 1, e - k + 1))
                    break
                continue
            break
    return res

def main():
    args = [a for a in sys.argv[1:] if not a.startswith('--')]
    root = pathlib.Path(args[0] if args else pathlib.Path(__file__).resolve().parent.parent)
    big_files, long_fns = [], []
    for f in sorted((root / 'crates').glob('*/src/**/*.rs')):
        rel = f.relative_to(root).as_posix()
        n = f.read_text().count('\n')
        if n > 1000:
            big_files.append((n, rel))
        for name, line, length in functions(f):
            if length > 100:
                long_fns.append((length, f"{rel}:{line} {name}"))
    print(f"files over 1000 lines: {len(big_files)}")
    print(f"functions over 100 lines: {len(long_fns)}")
    if '--list' in sys.argv:
        for n, r in sorted(big_files, reverse=True):
            print(f"  file {n:5} {r}")
        for n, r in sorted(long_fns, reverse=True):
            print(f"  fn   {n:5} {r}")

main()
