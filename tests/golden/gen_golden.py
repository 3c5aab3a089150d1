#!/usr/bin/env python3
"""Regenerate the golden vectors in tests/golden/data/ (deterministic).

    python3 tests/golden/gen_golden.py

For each config NAME it writes
    NAME.model.safetensors    the weights (neurollm/1 checkpoint, F32)
    NAME.batch.safetensors    tokens, targets: I64 [B, T]
    NAME.forward.safetensors  logits F32 [B, T, vocab_size], aux_loss F32 []
    NAME.grads.safetensors    d loss / d weight under each weight's name
                              (full [C, d] tables), and F32 scalars loss,
                              ce_loss, aux_loss

The weights are drawn in float32 and then stored; the forward and backward
passes run in float64 on those exact float32 values (RoPE cos/sin are
rounded to float32 as the runtime does), and only the results are rounded to
float32. The goldens are thus the exact answer, to float32 rounding, for the
stored inputs, and a float32 implementation should match them to ~1e-6
(relative, norm-wise).

The weights are deliberately far from a realistic init (larger std) so that
attention is far from uniform and routing is decisive: the test is then
sensitive to mistakes. A seed whose routing has a near tie (the k-th and
(k+1)-th router logits closer than MIN_ROUTER_GAP for some token) is skipped
for the next one, so rounding differences cannot flip an expert choice.
"""

import os
import sys

try:
    import torch
except ImportError:  # a python3 without Debian's python3-torch first in PATH
    if os.path.exists("/usr/bin/python3") and os.path.realpath(
            sys.executable) != os.path.realpath("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nlref  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
MIN_ROUTER_GAP = 1e-3

# name: (config keys, batch, seq, base seed)
CONFIGS = {
    "odd": (dict(vocab_size=300, vocab_chunk=128, hidden_dim=96, num_layers=2,
                 num_heads=6, num_kv_heads=3, ffn_dim=80, num_experts=8,
                 top_k=2, max_seq_len=64), 3, 37, 1000),
    "t1": (dict(vocab_size=256, vocab_chunk=256, hidden_dim=64, num_layers=2,
                num_heads=4, num_kv_heads=1, ffn_dim=128, num_experts=8,
                top_k=2, max_seq_len=16), 2, 1, 2000),
    "long": (dict(vocab_size=200, vocab_chunk=256, hidden_dim=64,
                  num_layers=2, num_heads=2, num_kv_heads=2, ffn_dim=64,
                  num_experts=4, top_k=1, max_seq_len=256), 1, 200, 3000),
    "topk3": (dict(vocab_size=100, vocab_chunk=64, hidden_dim=32,
                   num_layers=3, num_heads=2, num_kv_heads=1, ffn_dim=48,
                   num_experts=6, top_k=3, max_seq_len=32, aux_loss_coef=0.05,
                   rope_base=500.0, norm_eps=1e-5), 2, 19, 4000),
}

# std of the normal draw per weight kind (norm weights: 1 + 0.1 * normal)
STD = {"tok_embeddings": 1.0, "wq": 0.25, "wk": 0.25, "wv": 0.2, "wo": 0.15,
       "router": 0.3, "w_gate": 0.2, "w_up": 0.2, "w_down": 0.15,
       "lm_head": 0.15}


def sensitive_weights(cfg, gen):
    """Float32 weights with the larger stds of STD (see the module doc)."""
    out = {}
    for name, shape in nlref.weight_shapes(cfg).items():
        z = torch.randn(shape, generator=gen, dtype=torch.float32)
        if len(shape) == 1:
            out[name] = 1.0 + 0.1 * z
        else:
            kind = name.split(".")[-2]
            out[name] = z * STD[kind]
    return out


def make_case(cfg_kw, batch, seq, seed):
    """Draw weights and a batch, retrying seeds until the routing is
    decisive. Returns (cfg, weights, tokens, targets, seed)."""
    cfg = nlref.make_config(**cfg_kw)
    for s in range(seed, seed + 100):
        gen = torch.Generator().manual_seed(s)
        weights = sensitive_weights(cfg, gen)
        tokens = torch.randint(0, cfg["vocab_size"], (batch, seq),
                               generator=gen, dtype=torch.int64)
        targets = torch.randint(0, cfg["vocab_size"], (batch, seq),
                                generator=gen, dtype=torch.int64)
        model = nlref.NeuroLLM(cfg, weights).double()
        gaps = nlref.router_margins(model, tokens)
        if min(gaps) >= MIN_ROUTER_GAP:
            return cfg, weights, tokens, targets, s
        print("  seed %d: router gap %.2e too small, next seed" %
              (s, min(gaps)))
    raise RuntimeError("no seed with decisive routing")


def golden(cfg, weights, tokens, targets):
    """Forward and backward in float64; results rounded to float32."""
    model = nlref.NeuroLLM(cfg, weights).double()
    loss, ce, aux, logits = nlref.forward_loss(model, tokens, targets)
    loss.backward()
    fwd = {"logits": logits.detach().float(), "aux_loss": aux.detach().float()}
    # Experts no token was routed to get no .grad: their gradient is zero.
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad).float()
             for n, p in model.named_parameters()}
    grads.update(loss=loss.detach().float(), ce_loss=ce.detach().float(),
                 aux_loss=aux.detach().float())
    return fwd, grads


def describe(cfg, weights, tokens):
    """A line on how peaked attention and routing are (for the log)."""
    model = nlref.NeuroLLM(cfg, weights).double()
    probs = []

    def hook(mod, inp, out):
        probs.append(torch.softmax(out, -1).max(-1).values.mean().item())

    handles = [layer.moe.router.register_forward_hook(hook)
               for layer in model.layers]
    with torch.no_grad():
        logits, _ = model(tokens)
    for h in handles:
        h.remove()
    return "mean top router prob %s, logits std %.2f" % (
        " ".join("%.2f" % p for p in probs), logits.std().item())


def main():
    os.makedirs(DATA, exist_ok=True)
    torch.set_num_threads(1)
    total = 0
    for name, (cfg_kw, batch, seq, seed) in CONFIGS.items():
        cfg, weights, tokens, targets, used = make_case(cfg_kw, batch, seq,
                                                        seed)
        fwd, grads = golden(cfg, weights, tokens, targets)
        base = os.path.join(DATA, name)
        nlref.save_checkpoint(base + ".model.safetensors", cfg, weights)
        nlref.save_safetensors(base + ".batch.safetensors",
                               {"tokens": tokens, "targets": targets},
                               {"seed": str(used)})
        nlref.save_safetensors(base + ".forward.safetensors", fwd)
        nlref.save_safetensors(base + ".grads.safetensors", grads)
        sizes = [os.path.getsize(base + s) for s in
                 (".model.safetensors", ".batch.safetensors",
                  ".forward.safetensors", ".grads.safetensors")]
        total += sum(sizes)
        print("%-6s seed %d  loss %.6f ce %.6f aux %.6f  %s" %
              (name, used, grads["loss"], grads["ce_loss"], grads["aux_loss"],
               describe(cfg, weights, tokens)))
        print("       bytes: model %d, batch %d, forward %d, grads %d" %
              tuple(sizes))
    print("total %d bytes (%.2f MB) in %s" % (total, total / 1e6, DATA))


if __name__ == "__main__":
    main()
