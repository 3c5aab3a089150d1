#!/usr/bin/env python3
"""Compares two training runs of the cluster tests (test_cluster_replicas.sh,
test_cluster_replica_stages.sh):
  logs A B TOL            every step's losses of log A within TOL of B's,
                          relative (0: equal), and the same steps skipped
  weights A B TOL [MTOL]  every weight tensor of checkpoint A (or adapter
                          file) within TOL of B's, relative (0: every
                          byte), the optimizer's moments within MTOL
                          (default TOL)
Exits non-zero (an assertion) on the first difference beyond them."""
import json, struct, sys
def log(p):
    return {r["step"]: r for r in map(json.loads, open(p)) if "step" in r}
def tensors(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    out = {}
    for k, v in h.items():
        if k == "__metadata__": continue
        s, e = v["data_offsets"]; out[k] = b[8 + n + s: 8 + n + e]
    return out
def floats(raw):
    return struct.unpack("<%df" % (len(raw) // 4), raw)
def rel(a, b):
    num = sum((x - y) ** 2 for x, y in zip(a, b)); den = sum(y * y for y in b)
    return (num / den) ** 0.5 if den else num ** 0.5
what = sys.argv[1]
if what == "logs":      # logs A B TOL: every step's losses within TOL (0: equal)
    a, b, tol = log(sys.argv[2]), log(sys.argv[3]), float(sys.argv[4])
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    worst = 0.0
    for k in b:
        for key in ("loss", "ce_loss", "eval_loss"):
            if key in b[k]:
                assert key in a[k], (k, key)
                e = abs(a[k][key] - b[k][key]) / abs(b[k][key]); worst = max(worst, e)
                assert e <= tol, (k, key, a[k][key], b[k][key])
        assert a[k]["skipped"] == b[k]["skipped"], (k, a[k]["skipped"])
    print("losses of %d steps: worst relative difference %.2e" % (len(b), worst))
elif what == "weights":  # weights A B TOL [MTOL]: every weight within TOL (0: every byte), moments MTOL
    a, b, tol = tensors(sys.argv[2]), tensors(sys.argv[3]), float(sys.argv[4])
    mtol = float(sys.argv[5]) if len(sys.argv) > 5 else tol
    assert set(a) == set(b), set(a) ^ set(b)
    if tol == 0:
        diff = [k for k in b if a[k] != b[k]]
        print("%d tensors, %d differ in a byte" % (len(b), len(diff)))
        assert not diff, diff[:5]
    else:
        for moments in (False, True):
            errs = sorted((rel(floats(a[k]), floats(b[k])), k) for k in b
                          if k.startswith("optim.") == moments)
            if not errs:  # an adapter file has no moments
                assert moments, "no weights"
                continue
            worst, limit = errs[-1][0], mtol if moments else tol
            print("%d %s: worst relative error %.2e (%s)" % (len(errs),
                  "moments" if moments else "weights", worst, errs[-1][1]))
            assert worst <= limit, (errs[-1], limit)
