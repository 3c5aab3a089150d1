#!/usr/bin/env python3
"""Count pairs of repeated blocks in the C sources: runs of six or more lines
of the same shape in two places (two files, or two functions of one file).

A line's shape is the line with comments and blank lines dropped, string and
character literals replaced by S and numbers by N (with --ids, identifiers by
I too), so two flag tables that differ only in names, help and ranges count
as one shape. Lines that are a lone brace (or brace plus semicolon) are dropped too:
they carry no shape of their own. A pair is one maximal run: overlapping
windows of the same two places count once.

usage: scripts/dupblocks.py [--min N] [--ids] [--list] [DIR...]
  (default dirs: base kernels core net serve node coordinator cli)
"""
import argparse
import collections
import os
import re
import sys

NORM_IDS = False  # --ids: identifiers count as one shape too
DIRS = ["base", "kernels", "core", "net", "serve", "node", "coordinator", "cli"]
KEYWORDS = set(
    """auto break case char const continue default do double else enum extern float
    for goto if inline int long register restrict return short signed sizeof static
    struct switch typedef union unsigned void volatile while bool NULL""".split()
)
TOKEN = re.compile(
    r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|[A-Za-z_]\w*|\d[\w.]*|\S'
)


def strip_comments(text):
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))  # keep line numbers
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text[i] in "\"'":
            q, j = text[i], i + 1
            while j < n and text[j] != q and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def shape(line):
    toks = []
    for t in TOKEN.findall(line):
        if t[0] in "\"'":
            toks.append("S")
        elif t[0].isdigit():
            toks.append("N")
        elif t[0].isalpha() or t[0] == "_":
            toks.append(t if t in KEYWORDS or not NORM_IDS else "I")
        else:
            toks.append(t)
    # adjacent string literals are one literal
    s = " ".join(toks)
    while "S S" in s:
        s = s.replace("S S", "S")
    return s


def function_of(lines):
    """For each line index, the index of the function (top-level brace
    block) it is in, or -1 outside any."""
    owner, depth, fn = [], 0, -1
    for i, l in enumerate(lines):
        if depth == 0 and "{" in l:
            fn = i
        owner.append(fn if depth > 0 or "{" in l else -1)
        depth += l.count("{") - l.count("}")
        if depth <= 0:
            depth = 0
    return owner


def load(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        raw = strip_comments(f.read()).split("\n")
    owner = function_of(raw)
    kept = []  # (line number, shape, function)
    for i, l in enumerate(raw):
        s = l.strip()
        if not s or s.startswith("#") or re.fullmatch(r"[{}();,\s]*", s):
            continue
        kept.append((i + 1, shape(s), owner[i]))
    return kept


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min", type=int, default=6, help="lines in a block (default 6)")
    ap.add_argument("--list", action="store_true", help="print each pair")
    ap.add_argument("--ids", action="store_true", help="identifiers as one shape (I) too")
    ap.add_argument("dirs", nargs="*", default=DIRS)
    a = ap.parse_args()
    global NORM_IDS
    NORM_IDS = a.ids
    files = {}
    for d in a.dirs:
        for root, _, names in os.walk(d):
            for nm in sorted(names):
                if nm.endswith((".c", ".h", ".cu", ".cuh")):
                    p = os.path.join(root, nm)
                    files[p] = load(p)
    index = collections.defaultdict(list)
    for p, kept in files.items():
        for k in range(len(kept) - a.min + 1):
            key = tuple(x[1] for x in kept[k : k + a.min])
            index[key].append((p, k))
    # windows matching at (p, k) and (q, m): a pair; consecutive windows with
    # the same offsets extend one run
    matches = set()
    for locs in index.values():
        if len(locs) < 2 or len(locs) > 50:  # 50+: boilerplate, not a copy
            continue
        for i in range(len(locs)):
            for j in range(i + 1, len(locs)):
                (p, k), (q, m) = locs[i], locs[j]
                if p == q:
                    fk, fm = files[p][k][2], files[q][m][2]
                    if fk == fm or abs(k - m) < a.min:
                        continue
                matches.add((p, k, q, m))
    runs = []
    for p, k, q, m in sorted(matches):
        if (p, k - 1, q, m - 1) in matches:
            continue
        n = 0
        while (p, k + n, q, m + n) in matches:
            n += 1
        runs.append((p, k, q, m, n + a.min - 1))
    if a.list:
        for p, k, q, m, n in runs:
            print(f"{n:3d}  {p}:{files[p][k][0]}  {q}:{files[q][m][0]}")
    print(f"{len(runs)} pairs of repeated blocks ({a.min}+ lines) in {' '.join(a.dirs)}")


if __name__ == "__main__":
    sys.exit(main())
