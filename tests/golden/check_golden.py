#!/usr/bin/env python3
"""Self-check of the golden vectors in tests/golden/data/.

    python3 tests/golden/check_golden.py

For every config it
  1. recomputes logits, aux, loss and all gradients with nlref in float32 and
     prints the relative norm-wise error ||got - golden|| / ||golden|| (the
     yardstick for a float32 implementation: ~1e-6);
  2. recomputes them with nlref in float64 (must agree to float32 rounding:
     the files are what gen_golden.py makes);
  3. recomputes them with `naive`, a second, loop-based implementation of
     DESIGN section 2 written independently of nlref's vectorised code
     (rotation matrices for RoPE, per-head loops for GQA, dense experts
     with a 0/1 routing mask), in float64 with autograd;
  4. checks structural facts: lm_head rows past vocab_size and embedding rows
     of absent tokens have zero gradient;
  5. checks KV-cache decoding (prefill + one token at a time) against the
     full forward pass.
On `odd` it also compares autograd with central finite differences in
float64 for entries of every kind of weight, including the router (through
the routing weights and the aux loss). Exits 1 if any check fails.
"""

import math
import os
import sys

try:
    import torch
except ImportError:  # a python3 without Debian's python3-torch first in PATH
    if os.path.exists("/usr/bin/python3") and os.path.realpath(
            sys.executable) != os.path.realpath("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nlref  # noqa: E402
from gen_golden import CONFIGS, DATA  # noqa: E402

TOL_F32 = 1e-4   # float32 recompute vs golden (observed ~1e-6)
TOL_F64 = 1e-7   # float64 recompute vs golden (float32 rounding only)
failures = []


def rel(got, want):
    got, want = got.double(), want.double()
    den = want.norm().item()
    num = (got - want).norm().item()
    return num / den if den > 0 else num


def expect(ok, what):
    if not ok:
        failures.append(what)
        print("  FAIL:", what)


def nlref_results(cfg, weights, tokens, targets, dtype):
    model = nlref.NeuroLLM(cfg, weights).to(dtype)
    loss, ce, aux, logits = nlref.forward_loss(model, tokens, targets)
    loss.backward()
    res = {"logits": logits.detach(), "aux_loss": aux.detach(),
           "loss": loss.detach(), "ce_loss": ce.detach()}
    for n, p in model.named_parameters():
        res["grad:" + n] = torch.zeros_like(p) if p.grad is None else p.grad
    return res


# ------------------------------------------------ the naive implementation --


def naive_rmsnorm(x, w, eps):
    ms = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    return x / torch.sqrt(ms + eps) * w


def naive_rotation(t, hd, base, dtype):
    """[t, hd, hd]: block-diagonal 2x2 rotations, one per position."""
    rot = torch.zeros(t, hd, hd, dtype=dtype)
    for p in range(t):
        for i in range(hd // 2):
            theta = p * base ** (-2.0 * i / hd)
            c = float(torch.tensor(math.cos(theta), dtype=torch.float32))
            s = float(torch.tensor(math.sin(theta), dtype=torch.float32))
            rot[p, 2 * i, 2 * i], rot[p, 2 * i, 2 * i + 1] = c, -s
            rot[p, 2 * i + 1, 2 * i], rot[p, 2 * i + 1, 2 * i + 1] = s, c
    return rot


def naive_loss(cfg, w, tokens, targets):
    """(loss, ce, aux, logits) straight from the DESIGN formulas."""
    d, n_h, n_g = cfg["hidden_dim"], cfg["num_heads"], cfg["num_kv_heads"]
    hd, n_e, k = d // n_h, cfg["num_experts"], cfg["top_k"]
    b, t = tokens.shape
    dt = w["norm.weight"].dtype
    rot = naive_rotation(t, hd, cfg["rope_base"], dt)
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    x = w["tok_embeddings.weight"][tokens.reshape(-1)].reshape(b, t, d)
    aux_sum = 0
    for l in range(cfg["num_layers"]):
        p = "layers.%d." % l
        a = naive_rmsnorm(x, w[p + "attention_norm.weight"], cfg["norm_eps"])
        q = a @ w[p + "attention.wq.weight"].t()
        kk = a @ w[p + "attention.wk.weight"].t()
        v = a @ w[p + "attention.wv.weight"].t()
        heads = []
        for h in range(n_h):
            g = h // (n_h // n_g)
            qh = torch.einsum("ptj,tij->pti", q[..., h * hd:(h + 1) * hd], rot)
            kh = torch.einsum("ptj,tij->pti", kk[..., g * hd:(g + 1) * hd],
                              rot)
            s = qh @ kh.transpose(1, 2) / math.sqrt(hd)
            s = s.masked_fill(mask, float("-inf"))
            heads.append(torch.softmax(s, -1) @ v[..., g * hd:(g + 1) * hd])
        h1 = x + torch.cat(heads, -1) @ w[p + "attention.wo.weight"].t()
        f = naive_rmsnorm(h1, w[p + "ffn_norm.weight"],
                          cfg["norm_eps"]).reshape(b * t, d)
        probs = torch.softmax(f @ w[p + "moe.router.weight"].t(), -1)
        sel = torch.zeros(b * t, n_e, dtype=dt)
        for i in range(b * t):
            pi = probs[i].tolist()
            for e in sorted(range(n_e), key=lambda j: (-pi[j], j))[:k]:
                sel[i, e] = 1.0
        gate = probs * sel
        gate = gate / gate.sum(-1, keepdim=True)
        y = 0
        for e in range(n_e):
            q_ = p + "moe.experts.%d." % e
            hid = F.silu(f @ w[q_ + "w_gate.weight"].t()) * \
                (f @ w[q_ + "w_up.weight"].t())
            y = y + gate[:, e:e + 1] * (hid @ w[q_ + "w_down.weight"].t())
        frac = sel.sum(0) / (b * t * k)
        aux_sum = aux_sum + n_e * (frac * probs.mean(0)).sum()
        x = h1 + y.reshape(b, t, d)
    xn = naive_rmsnorm(x, w["norm.weight"], cfg["norm_eps"])
    logits = xn @ w["lm_head.weight"][:cfg["vocab_size"]].t()
    logp = torch.log_softmax(logits, -1)
    ce = -logp.gather(-1, targets[..., None]).mean()
    return ce + cfg["aux_loss_coef"] * aux_sum, ce, aux_sum, logits


def naive_results(cfg, weights, tokens, targets):
    w = {n: v.double().requires_grad_(True) for n, v in weights.items()}
    loss, ce, aux, logits = naive_loss(cfg, w, tokens, targets)
    names = list(w)
    grads = torch.autograd.grad(loss, [w[n] for n in names],
                                allow_unused=True)
    res = {"logits": logits.detach(), "aux_loss": aux.detach(),
           "loss": loss.detach(), "ce_loss": ce.detach()}
    for n, g in zip(names, grads):
        res["grad:" + n] = torch.zeros_like(w[n]) if g is None else g
    return res


# --------------------------------------------------------------- checks --


def compare(label, res, want, tol):
    """Print the worst relative error of res against the golden dict."""
    worst, worst_name = 0.0, ""
    errs = {}
    for key, ref in want.items():
        e = rel(res[key], ref)
        errs[key] = e
        if e > worst:
            worst, worst_name = e, key
    grad_errs = sorted(v for k, v in errs.items() if k.startswith("grad:"))
    print("  %-8s logits %.1e  aux %.1e  loss %.1e  ce %.1e  grads median "
          "%.1e max %.1e (worst: %s)" %
          (label, errs["logits"], errs["aux_loss"], errs["loss"],
           errs["ce_loss"], grad_errs[len(grad_errs) // 2], grad_errs[-1],
           worst_name))
    expect(worst <= tol, "%s: %s error %.2e > %.0e" %
           (label, worst_name, worst, tol))


def check_structure(cfg, tokens, grads):
    head = grads["grad:lm_head.weight"]
    expect(bool((head[cfg["vocab_size"]:] == 0).all()),
           "lm_head rows past vocab_size have nonzero gradient")
    emb = grads["grad:tok_embeddings.weight"]
    absent = torch.ones(emb.shape[0], dtype=torch.bool)
    absent[tokens.reshape(-1)] = False
    expect(bool((emb[absent] == 0).all()),
           "embedding rows of absent tokens have nonzero gradient")
    expect(bool((emb[~absent] != 0).any(dim=1).all()),
           "embedding rows of present tokens have zero gradient")


def check_decode(cfg, weights, tokens):
    """Prefill a prefix, then feed one token at a time through the cache."""
    model = nlref.NeuroLLM(cfg, weights).double()
    with torch.no_grad():
        full, _ = model(tokens)
        caches = [{} for _ in range(cfg["num_layers"])]
        n0 = min(3, tokens.shape[1])
        parts = [model(tokens[:, :n0], caches)[0]]
        for i in range(n0, tokens.shape[1]):
            parts.append(model(tokens[:, i:i + 1], caches)[0])
    e = rel(torch.cat(parts, 1), full)
    print("  decode   KV-cache logits vs full forward %.1e" % e)
    expect(e < 1e-12, "KV-cache decoding differs from forward: %.2e" % e)


def unravel(flat, shape):
    """Flat index -> index tuple (torch 1.13 has no unravel_index)."""
    idx = []
    for n in reversed(shape):
        idx.append(flat % n)
        flat //= n
    return tuple(reversed(idx))


def finite_differences(cfg, weights, tokens, targets):
    """Central differences in float64 on entries of every kind of weight."""
    model = nlref.NeuroLLM(cfg, weights).double()
    params = dict(model.named_parameters())
    loss, _, aux, _ = nlref.forward_loss(model, tokens, targets)
    g_loss = torch.autograd.grad(loss, list(params.values()),
                                 allow_unused=True, retain_graph=True)
    g_aux = torch.autograd.grad(aux, [params["layers.1.moe.router.weight"],
                                      params["layers.0.moe.router.weight"]])
    g_loss = dict(zip(params, g_loss))
    gen = torch.Generator().manual_seed(7)
    names = ["tok_embeddings.weight", "lm_head.weight", "norm.weight"]
    for l in range(cfg["num_layers"]):
        names += ["layers.%d.%s.weight" % (l, s) for s in (
            "attention_norm", "attention.wq", "attention.wk", "attention.wv",
            "attention.wo", "ffn_norm", "moe.router",
            "moe.experts.3.w_gate", "moe.experts.3.w_up",
            "moe.experts.3.w_down")]
    h = 1e-6

    def value(fn, name, idx, delta):
        with torch.no_grad():
            old = params[name][idx].item()
            params[name][idx] = old + delta
            v = fn().item()
            params[name][idx] = old
        return v

    def loss_only():
        return nlref.forward_loss(model, tokens, targets)[0]

    def aux_only():
        return model(tokens)[1]

    worst = 0.0
    checked = 0
    for name in names:
        g = g_loss[name]
        # the entry with the largest gradient, and one random entry
        picks = [unravel(int(g.abs().argmax()), g.shape),
                 unravel(int(torch.randint(0, g.numel(), (1,),
                                           generator=gen)), g.shape)]
        for idx in picks:
            fd = (value(loss_only, name, idx, h) -
                  value(loss_only, name, idx, -h)) / (2 * h)
            ad = g[idx].item()
            err = abs(fd - ad)
            ok = err <= 1e-8 + 1e-5 * abs(ad)
            worst = max(worst, err / max(abs(ad), 1e-3))
            checked += 1
            expect(ok, "finite difference %s%s: fd %.10g autograd %.10g" %
                   (name, list(idx), fd, ad))
    # the aux loss alone, through the router (frac_e is piecewise constant)
    for name, g in zip(["layers.1.moe.router.weight",
                        "layers.0.moe.router.weight"], g_aux):
        idx = unravel(int(g.abs().argmax()), g.shape)
        fd = (value(aux_only, name, idx, h) -
              value(aux_only, name, idx, -h)) / (2 * h)
        ad = g[idx].item()
        worst = max(worst, abs(fd - ad) / max(abs(ad), 1e-3))
        checked += 1
        expect(abs(fd - ad) <= 1e-8 + 1e-5 * abs(ad),
               "finite difference of aux %s%s: fd %.10g autograd %.10g" %
               (name, list(idx), fd, ad))
        print("  fd       d aux / d %s%s = %.6g (autograd %.6g)" %
              (name, list(idx), fd, ad))
    print("  fd       %d entries, worst |fd - autograd| / max(|g|, 1e-3) "
          "= %.1e" % (checked, worst))


def main():
    torch.set_num_threads(1)
    for name in CONFIGS:
        base = os.path.join(DATA, name)
        cfg, weights, _ = nlref.load_checkpoint(base + ".model.safetensors")
        batch, _ = nlref.load_safetensors(base + ".batch.safetensors")
        fwd, _ = nlref.load_safetensors(base + ".forward.safetensors")
        grads, _ = nlref.load_safetensors(base + ".grads.safetensors")
        tokens, targets = batch["tokens"], batch["targets"]
        want = {"logits": fwd["logits"], "aux_loss": fwd["aux_loss"],
                "loss": grads["loss"], "ce_loss": grads["ce_loss"]}
        expect(torch.equal(fwd["aux_loss"], grads["aux_loss"]),
               "%s: aux_loss differs between forward and grads files" % name)
        for n in weights:
            want["grad:" + n] = grads[n]
        expect(set(grads) == set(weights) |
               {"loss", "ce_loss", "aux_loss"},
               "%s: grads file names differ from the weights" % name)
        print("%s: B=%d T=%d" % (name, tokens.shape[0], tokens.shape[1]))
        compare("float32", nlref_results(cfg, weights, tokens, targets,
                                         torch.float32), want, TOL_F32)
        compare("float64", nlref_results(cfg, weights, tokens, targets,
                                         torch.float64), want, TOL_F64)
        compare("naive64", naive_results(cfg, weights, tokens, targets),
                want, TOL_F64)
        check_structure(cfg, tokens, want)
        check_decode(cfg, weights, tokens)
        if name == "odd":
            finite_differences(cfg, weights, tokens, targets)
    if failures:
        print("%d check(s) FAILED" % len(failures))
        sys.exit(1)
    print("all golden checks passed")


if __name__ == "__main__":
    main()
