#!/usr/bin/env python3
"""Every flag the README and docs/ name exists in the --help of its command.

`neuroctl help COMMAND` must print what `neuroctl COMMAND --help` prints,
for every command the general usage lists.

A flag after a command on the same line (`neuroctl train ... --out`,
`neurocoord --node-timeout-ms`, `neuronode join ... --memory`) must be in
that command's --help; a code block's continuation line (one that starts
with `[` or `--`) belongs to the command of the line above. A flag named
without a command (prose, tables) must be in the --help of at least one of
the project's commands. Flags of other tools on a line (cmake, ctest,
python, ...) are not ours and are skipped. Exit 0 when every flag is found;
else each missing one is listed as FILE:LINE: --flag (COMMAND) and exit 1.

Run by ctest with NL_SOURCE_DIR and NL_BUILD_DIR set.
"""
import glob
import os
import re
import subprocess
import sys

SRC = os.environ.get("NL_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
BUILD = os.environ.get("NL_BUILD_DIR", os.path.join(SRC, "build"))
NEUROCTL = os.path.join(BUILD, "cli", "neuroctl")
NEUROCOORD = os.path.join(BUILD, "coordinator", "neurocoord")
NEURONODE = os.path.join(BUILD, "node", "neuronode")

SUBCOMMANDS = ["init", "forward", "generate", "grad", "train", "grow", "export", "bench",
               "status", "cluster", "keygen", "tokenizer", "selftest", "serve", "import"]
# these go to a cluster with --cluster: their flags there are part of them too
REMOTE = ["forward", "generate", "train"]
# ... and these with a subcommand of their own
REMOTE_ARGV = {"grow": ["grow", "--cluster", "x", "--help"],
               "tokenizer": ["tokenizer", "learn", "--cluster", "x", "--help"]}
# a command of another tool: the flags after it on a line are its own
FOREIGN = re.compile(r"(?<![\w-])(cmake|ctest|python3?|pip3?|git|bash|apt(-get)?|perf|valgrind|"
                     r"nvidia-smi|torchrun|clang|gcc|nvcc|timeout|taskset|numactl|"
                     r"bench_\w+|BENCH_\w+|test_\w+|[\w./-]+\.(sh|py))(?![\w-])")
COMMAND = re.compile(r"(?<![\w-])(neuroctl\s+(?:" + "|".join(SUBCOMMANDS) +
                     r")|neurocoord|neuronode)(?![\w-])")
# flags of the project's scripts named in prose away from the script's name:
# each must still be in that script
SCRIPT_FLAGS = {
    "stock-malloc": "bench/torch_train.py",
    "serve": "scripts/demo.sh",
    "ids": "scripts/dupblocks.py",
}
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*[a-z0-9])")


def help_of(argv):
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.stdout


def all_helps():
    helps = {}
    for sub in SUBCOMMANDS:
        h = help_of([NEUROCTL, sub, "--help"])
        if sub in REMOTE:
            h += help_of([NEUROCTL, sub, "--cluster", "x", "--help"])
        if sub in REMOTE_ARGV:
            h += help_of([NEUROCTL] + REMOTE_ARGV[sub])
        helps["neuroctl " + sub] = h
    # the general usage: flags of neuroctl itself (--version)
    helps["neuroctl"] = help_of([NEUROCTL, "--help"])
    helps["neurocoord"] = help_of([NEUROCOORD, "--help"])
    helps["neuronode"] = help_of([NEURONODE, "join", "--help"])
    return helps


def check_help_command():
    """neuroctl help CMD prints CMD's own usage (issue 34: help train printed
    the general one), for every command of the general usage."""
    general = help_of([NEUROCTL, "--help"])
    cmds = re.findall(r"^  ([a-z]+)  ", general.split("commands:", 1)[-1], re.M)
    bad = []
    if len(cmds) < len(SUBCOMMANDS):
        bad.append("neuroctl --help lists %d commands: %r" % (len(cmds), cmds))
    for c in cmds:
        own = help_of([NEUROCTL, c, "--help"])
        via = help_of([NEUROCTL, "help", c])
        if not own.startswith("usage: neuroctl " + c) or via != own:
            bad.append("neuroctl help %s: %r, neuroctl %s --help: %r" % (c, via[:80], c, own[:80]))
    return bad


def flags_in(text):
    return set(FLAG.findall(text))


def segments(text, cmd):
    """text cut at each command (ours or another tool's), each piece with
    its owner: a command name, "" (none) or None (another tool)."""
    marks = [(m.start(), re.sub(r"\s+", " ", m.group(1))) for m in COMMAND.finditer(text)]
    marks += [(m.start(), None) for m in FOREIGN.finditer(text)]
    marks.sort(key=lambda m: m[0])
    pos, out = 0, []
    for at, name in marks:
        out.append((text[pos:at], cmd))
        pos, cmd = at, name
    out.append((text[pos:], cmd))
    return out, [name for _, name in marks if name]


def check_file(path, helps, known):
    missing = []
    in_code = False
    last_cmd = None  # the command of the previous line of a code block
    for lineno, line in enumerate(open(path, encoding="utf-8"), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            last_cmd = None
            continue
        code = in_code or line.startswith("    ")
        if code:
            stripped = line.strip()
            cont = stripped.startswith("[") or stripped.startswith("--")
            pieces, ours = segments(line, last_cmd if cont else "")
            last_cmd = ours[-1] if ours else (last_cmd if cont else None)
        else:
            # prose: a command owns the flags of its own `code span` only
            pieces = []
            for k, span in enumerate(line.split("`")):
                pieces += segments(span, "")[0] if k % 2 else [(span, "")]
        for text, owner in pieces:
            if owner is None:
                continue  # another tool's flags
            for f in FLAG.findall(text):
                if f in SCRIPT_FLAGS:
                    script = os.path.join(SRC, SCRIPT_FLAGS[f])
                    if "--" + f not in open(script, encoding="utf-8").read():
                        missing.append("%s:%d: --%s (not in %s)" % (path, lineno, f, script))
                elif owner and f not in flags_in(helps[owner]):
                    missing.append("%s:%d: --%s (not in %s --help)" % (path, lineno, f, owner))
                elif not owner and f not in known:
                    missing.append("%s:%d: --%s (in no command's --help)" % (path, lineno, f))
    return missing


def main():
    helps = all_helps()
    for name, h in helps.items():
        if "--help" not in h and "usage" not in h.lower():
            print("no help from %s: %r" % (name, h[:200]))
            return 1
    known = set()
    for h in helps.values():
        known |= flags_in(h)
    known.add("help")
    for h in helps:
        helps[h] += " --help"
    docs = [os.path.join(SRC, "README.md")] + sorted(glob.glob(os.path.join(SRC, "docs", "*.md")))
    missing = []
    for d in docs:
        missing += check_file(d, helps, known)
    for m in missing:
        print(m.replace(SRC.rstrip("/") + "/", ""))
    # the demo ends by naming what to try next: neuroctl commands, whose
    # flags are checked as the docs' are
    demo = os.path.join(SRC, "scripts", "demo.sh")
    text = open(demo).read()
    nxt = text[text.find("what next"):] if "what next" in text else ""
    if len(re.findall(r"^  neuroctl \w+ ", nxt, re.M)) < 2:
        missing.append("scripts/demo.sh: does not end by naming 2 neuroctl commands to try next")
    for m in re.finditer(r"^  neuroctl (\w+) ([^#\n]*)", nxt, re.M):
        own = helps.get("neuroctl " + m.group(1), "")
        for f in FLAG.findall(m.group(2)):
            if f not in flags_in(own):
                missing.append("scripts/demo.sh: what next: --%s (not in neuroctl %s --help)"
                               % (f, m.group(1)))
    print("check_doc_flags: %d files, %d flags known, %d missing" % (len(docs) + 1, len(known), len(missing)))
    bad_help = check_help_command()
    for b in bad_help:
        print(b)
    return 1 if missing or bad_help else 0


if __name__ == "__main__":
    sys.exit(main())
