#!/usr/bin/env python3
"""same_tensors.py A B: every tensor of two safetensors files is bit-identical,
and their metadata's step and adam_steps (where present) are equal.

The cluster tests' check that a disturbed run (a node killed, a join, a
re-balance, network faults, Ctrl-C and --resume) ends as an undisturbed one.
Prints "N tensors, K differ" and exits non-zero when any differs."""
import json
import struct
import sys


def tensors(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    return ({k: b[8 + n + v["data_offsets"][0]: 8 + n + v["data_offsets"][1]]
             for k, v in h.items() if k != "__metadata__"}, h.get("__metadata__", {}))


(a, ma), (b, mb) = tensors(sys.argv[1]), tensors(sys.argv[2])
diff = [k for k in b if a.get(k) != b[k]]
print("%d tensors, %d differ%s" % (len(b), len(diff), (": " + ", ".join(diff[:5])) if diff else ""))
assert set(a) == set(b), set(a) ^ set(b)
assert not diff
assert ma.get("step") == mb.get("step") and ma.get("adam_steps") == mb.get("adam_steps"), (ma, mb)
