#!/usr/bin/env python3
"""Check checkpoints grown by `neuroctl grow` against nlref and DESIGN
section 5 (the reference knows nothing of the C code's growth):

    check_grow.py NEUROCTL WORKDIR

From the golden model data/odd.model.safetensors (d 96, 6 heads, 3 kv
heads, F 80, L 2, vocab 300 in chunks of 128) it grows, with the C tool:
vocabulary 300 -> 400 (table rows 384 -> 512), depth 2 -> 4, then width
96 -> 128 with F 80 -> 96. For each it checks the weights by the rule of
section 5 (old blocks kept, the zero blocks zero, norm gains times
sqrt(r), norm_eps times r, heads and kv heads in the same ratio), then
runs nlref in float64 on data/odd.batch: the grown model's logits over the
old vocabulary equal the base model's (bit for bit for vocabulary and
depth, within 1e-5 relative for width), and `neuroctl forward` of the
widened checkpoint agrees with nlref within 1e-4, as the golden forward
test asks. Exits 1 on a mismatch.
"""
import json
import math
import os
import subprocess
import sys

try:
    import torch
except ImportError:  # a python3 without Debian's python3-torch first in PATH
    if os.path.exists("/usr/bin/python3") and os.path.realpath(
            sys.executable) != os.path.realpath("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import nlref  # noqa: E402

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def load(path):
    cfg, w, _ = nlref.load_checkpoint(path)
    w = {k: v for k, v in w.items() if not k.startswith("optim.")}
    _, meta = nlref.load_safetensors(path)
    return cfg, w, json.loads(meta.get("growth", "[]"))


def logits(cfg, w, tokens):
    model = nlref.NeuroLLM(cfg, w).double()
    with torch.no_grad():
        out, _ = model(tokens)
    return out


def corner(t, like):
    """The top-left block of t the shape of `like`."""
    return t[tuple(slice(0, n) for n in like.shape)]


def rest_zero(t, like):
    """Everything of t outside its top-left block the shape of `like` is 0."""
    m = torch.ones_like(t, dtype=torch.bool)
    m[tuple(slice(0, n) for n in like.shape)] = False
    return bool((t[m] == 0).all())


def check_vocab(b, g):
    (cb, wb, _), (cg, wg, hist) = b, g
    check(cg["vocab_size"] == 400 and nlref.capacity_rows(cg) == 512,
          "vocab: 400 active ids in 512 rows")
    same = all(torch.equal(corner(wg[k], v), v) for k, v in wb.items())
    check(same, "vocab: every old row and tensor kept")
    check(len(hist) == 1 and hist[0]["kind"] == "vocab", "vocab: history entry")


def check_depth(b, g):
    (cb, wb, _), (cg, wg, hist) = b, g
    check(cg["num_layers"] == 4, "depth: 4 layers")
    check(all(torch.equal(wg[k], v) for k, v in wb.items()),
          "depth: old tensors bit-identical")
    zero = ones = drawn = True
    for k, v in wg.items():
        if k in wb:
            continue
        if k.endswith("attention.wo.weight") or k.endswith("w_down.weight"):
            zero &= bool((v == 0).all())
        elif k.endswith("norm.weight"):
            ones &= bool((v == 1).all())
        else:
            drawn &= bool((v != 0).any()) and abs(v.std().item() - 0.02) < 0.005
    check(zero, "depth: new wo and w_down are zero (identity blocks)")
    check(ones, "depth: new norm gains are 1")
    check(drawn, "depth: other new tensors drawn from normal(0, 0.02)")
    check(len(hist) == 2 and hist[1]["kind"] == "depth" and
          hist[1]["before"]["num_layers"] == 2 and
          hist[1]["after"]["num_layers"] == 4, "depth: history entry")


def check_width(b, g):
    (cb, wb, _), (cg, wg, hist) = b, g
    r = cb["hidden_dim"] / cg["hidden_dim"]
    hd = cb["hidden_dim"] // cb["num_heads"]
    check(cg["hidden_dim"] == 128 and cg["ffn_dim"] == 96 and
          cg["hidden_dim"] // cg["num_heads"] == hd and cg["num_heads"] == 8 and
          cg["num_kv_heads"] == 4,
          "width: d 128, F 96, 8 heads of %d, 4 kv heads" % hd)
    check(abs(cg["norm_eps"] - cb["norm_eps"] * r) <= 1e-12 * cb["norm_eps"],
          "width: norm_eps times r")
    kept = norms = zeros = True
    for k, v in wb.items():
        t = wg[k]
        if k.endswith("norm.weight"):
            want_old = (v.double() * math.sqrt(r)).float()
            norms &= torch.equal(t[:v.shape[0]], want_old)
            norms &= bool((t[v.shape[0]:] == torch.tensor(math.sqrt(r),
                                                           dtype=torch.float32)).all())
            continue
        kept &= torch.equal(corner(t, v), v)
        if (k == "tok_embeddings.weight" or k.endswith("attention.wo.weight") or
                k.endswith("w_down.weight")):
            zeros &= rest_zero(t, v)
    check(kept, "width: every old block kept")
    check(norms, "width: norm gains times sqrt(r), new entries sqrt(r)")
    check(zeros, "width: tok_embeddings, wo, w_down zero outside the old block")
    check(len(hist) == 3 and hist[2]["kind"] == "width", "width: history entry")


def main():
    neuroctl, work = sys.argv[1:3]
    base = os.path.join(HERE, "data", "odd.model.safetensors")
    batch, _ = nlref.load_safetensors(os.path.join(HERE, "data",
                                                   "odd.batch.safetensors"))
    tokens = batch["tokens"].long()
    paths = {k: os.path.join(work, k + ".safetensors")
             for k in ("vocab", "deep", "wide")}
    steps = [["--model", base, "--out", paths["vocab"], "--vocab-size", "400"],
             ["--model", paths["vocab"], "--out", paths["deep"], "--layers", "4"],
             ["--model", paths["deep"], "--out", paths["wide"], "--hidden-dim",
              "128", "--ffn-dim", "96"]]
    for args in steps:
        subprocess.run([neuroctl, "grow", "--force"] + args, check=True,
                       stdout=subprocess.DEVNULL)
    b, v, d, w = load(base), load(paths["vocab"]), load(paths["deep"]), load(paths["wide"])
    check_vocab(b, v)
    check_depth(v, d)
    check_width(d, w)

    V = b[0]["vocab_size"]
    lb = logits(b[0], b[1], tokens)
    lv = logits(v[0], v[1], tokens)[..., :V]
    ld = logits(d[0], d[1], tokens)[..., :V]
    lw_full = logits(w[0], w[1], tokens)
    lw = lw_full[..., :V]
    # float64 GEMMs of another width may round differently: 1e-12, not bits
    rv = ((lv - lb).abs().max() / lb.abs().max()).item()
    check(rv < 1e-12, "nlref: vocab growth, old-vocabulary logits equal (max rel %.3g)" % rv)
    check(torch.equal(ld, lv), "nlref: depth growth, logits bit-identical")
    rel = ((lw - lb).abs().max() / lb.abs().max()).item()
    check(rel < 1e-5, "nlref: width growth, logits within 1e-5 (max rel %.3g)" % rel)

    # the C forward of the widened checkpoint against nlref
    toks = os.path.join(work, "tokens.safetensors")
    out = os.path.join(work, "logits.safetensors")
    nlref.save_safetensors(toks, {"tokens": tokens})
    subprocess.run([neuroctl, "forward", "--model", paths["wide"], "--tokens", toks,
                    "--out", out, "--threads", "2"], check=True, stdout=subprocess.DEVNULL)
    got, _ = nlref.load_safetensors(out)
    c = got["logits"].double()
    err = ((c - lw_full).norm() / lw_full.norm()).item()
    check(err < 1e-4, "neuroctl forward of the widened model vs nlref: rel err %.3g" % err)
    print("check_grow: %d failures" % len(failures))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
