#!/usr/bin/env python3
"""Regenerate the golden vectors in tests/golden/data/ (deterministic).

    python3 tests/golden/gen_golden.py [NAME ...]

(no NAME: every config of CONFIGS and FAMILIES). For each config NAME it
writes
    NAME.model.safetensors    the weights (neurollm/1 checkpoint, F32)
    NAME.batch.safetensors    tokens, targets: I64 [B, T] (targets < 0 are
                              ignored), and for packed rows doc: I64 [B, T]
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

# The model variants of DESIGN section 6 (encoders, GeGLU, dense FFN, local
# windows, YaRN, packed rows, ignored targets), each alone and combined:
# name: (config keys, batch, seq, base seed, docs per row, ignored share).
# check_golden.py's naive model covers section 2 only (CONFIGS); these are
# checked by test_golden.c against the C runtime, and by check_golden.py
# against a float64 nlref recompute and a masked-global reference.
_FAM = dict(vocab_size=120, vocab_chunk=64, hidden_dim=32, num_layers=2,
            num_heads=4, num_kv_heads=2, ffn_dim=40, num_experts=4, top_k=2,
            max_seq_len=128)
FAMILIES = {
    "enc": (dict(_FAM, causal=False), 2, 23, 5000, 1, 0.0),
    "geglu": (dict(_FAM, ffn_act="geglu"), 2, 21, 5100, 1, 0.0),
    "dense": (dict(_FAM, num_experts=1, top_k=1), 2, 19, 5200, 1, 0.0),
    "window": (dict(_FAM, num_layers=3, attention_window=16, global_every=2),
               1, 100, 5300, 1, 0.0),
    "encwin": (dict(_FAM, causal=False, attention_window=16,
                    global_every=2), 1, 100, 5400, 1, 0.0),
    "yarn": (dict(_FAM, max_seq_len=128,
                  rope_scaling=dict(type="yarn", factor=4.0,
                                    original_max_seq_len=32)),
             1, 100, 5500, 1, 0.0),
    "packed": (dict(_FAM), 2, 30, 5600, 3, 0.0),
    "ignore": (dict(_FAM), 2, 17, 5700, 1, 0.3),
    "combo": (dict(_FAM, num_layers=3, causal=False, ffn_act="geglu",
                   num_experts=1, top_k=1, attention_window=16,
                   global_every=2,
                   rope_scaling=dict(type="yarn", factor=4.0,
                                     original_max_seq_len=32)),
              1, 100, 5800, 3, 0.3),
}

# Classification heads (DESIGN 6): an encoder with GeGLU and alternating
# windows, sequences padded to T (the pads a document of their own), one
# label each: name: (config keys, batch, seq, base seed).
CLASSIFY = {
    "classify": (dict(_FAM, causal=False, ffn_act="geglu", attention_window=8,
                      global_every=2, num_classes=5), 3, 20, 5900),
}

# std of the normal draw per weight kind (norm weights: 1 + 0.1 * normal)
STD = {"tok_embeddings": 1.0, "wq": 0.25, "wk": 0.25, "wv": 0.2, "wo": 0.15,
       "router": 0.3, "w_gate": 0.2, "w_up": 0.2, "w_down": 0.15,
       "lm_head": 0.15, "classifier": 0.3}


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


def packed_docs(gen, batch, seq, docs):
    """Document ids [B, T]: each row cut into `docs` runs of random length
    (at least 2 positions each)."""
    out = torch.zeros(batch, seq, dtype=torch.int64)
    for b in range(batch):
        cuts = sorted(torch.randperm(seq - 3, generator=gen)[:docs - 1]
                      .add(2).tolist())
        for i, c in enumerate(cuts):
            out[b, c:] = i + 1
    return out


def make_case(cfg_kw, batch, seq, seed, docs=1, ignored=0.0):
    """Draw weights and a batch, retrying seeds until the routing is
    decisive. Returns (cfg, weights, tokens, targets, seed, doc); doc is
    None unless docs > 1; a share `ignored` of the targets is set to -1."""
    cfg = nlref.make_config(**cfg_kw)
    for s in range(seed, seed + 100):
        gen = torch.Generator().manual_seed(s)
        weights = sensitive_weights(cfg, gen)
        tokens = torch.randint(0, cfg["vocab_size"], (batch, seq),
                               generator=gen, dtype=torch.int64)
        targets = torch.randint(0, cfg["vocab_size"], (batch, seq),
                                generator=gen, dtype=torch.int64)
        doc = packed_docs(gen, batch, seq, docs) if docs > 1 else None
        if ignored > 0:
            drop = torch.rand(batch, seq, generator=gen) < ignored
            targets = targets.masked_fill(drop, -1)
        model = nlref.NeuroLLM(cfg, weights).double()
        gaps = nlref.router_margins(model, tokens, doc)
        if min(gaps) >= MIN_ROUTER_GAP:
            return cfg, weights, tokens, targets, s, doc
        print("  seed %d: router gap %.2e too small, next seed" %
              (s, min(gaps)))
    raise RuntimeError("no seed with decisive routing")


def golden(cfg, weights, tokens, targets, doc=None):
    """Forward and backward in float64; results rounded to float32."""
    model = nlref.NeuroLLM(cfg, weights).double()
    loss, ce, aux, logits = nlref.forward_loss(model, tokens, targets, doc)
    loss.backward()
    fwd = {"logits": logits.detach().float(), "aux_loss": aux.detach().float()}
    # Experts no token was routed to get no .grad: their gradient is zero.
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad).float()
             for n, p in model.named_parameters()}
    grads.update(loss=loss.detach().float(), ce_loss=ce.detach().float(),
                 aux_loss=aux.detach().float())
    return fwd, grads


def describe(cfg, weights, tokens, doc=None):
    """A line on how peaked attention and routing are (for the log)."""
    model = nlref.NeuroLLM(cfg, weights).double()
    probs = []

    def hook(mod, inp, out):
        probs.append(torch.softmax(out, -1).max(-1).values.mean().item())

    handles = [layer.moe.router.register_forward_hook(hook)
               for layer in model.layers if not nlref.dense(cfg)]
    with torch.no_grad():
        logits, _ = model(tokens, doc=doc)
    for h in handles:
        h.remove()
    return "mean top router prob %s, logits std %.2f" % (
        " ".join("%.2f" % p for p in probs), logits.std().item())


def classify_case(name, cfg_kw, batch, seq, seed):
    """Draw a padded, labelled batch and write the four files: the batch
    has tokens, lengths [B] and labels [B] (and doc: 0 valid, 1 pad); the
    forward file the LM logits of the same rows; grads the classifier
    loss's."""
    cfg = nlref.make_config(**cfg_kw)
    for s in range(seed, seed + 100):
        gen = torch.Generator().manual_seed(s)
        weights = sensitive_weights(cfg, gen)
        tokens = torch.randint(0, cfg["vocab_size"], (batch, seq),
                               generator=gen, dtype=torch.int64)
        lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=gen,
                                dtype=torch.int64)
        labels = torch.randint(0, cfg["num_classes"], (batch,),
                               generator=gen, dtype=torch.int64)
        doc = (torch.arange(seq)[None, :] >= lengths[:, None]).to(torch.int64)
        tokens = tokens.masked_fill(doc.bool(), 0)
        model = nlref.NeuroLLM(cfg, weights).double()
        if min(nlref.router_margins(model, tokens, doc)) >= MIN_ROUTER_GAP:
            break
    logits, aux = model(tokens, doc=doc)
    loss, ce, aux2 = nlref.classify_loss(model, tokens, lengths, labels, doc)
    loss.backward()
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad).float()
             for n, p in model.named_parameters()}
    grads.update(loss=loss.detach().float(), ce_loss=ce.detach().float(),
                 aux_loss=aux2.detach().float())
    base = os.path.join(DATA, name)
    nlref.save_checkpoint(base + ".model.safetensors", cfg, weights)
    nlref.save_safetensors(base + ".batch.safetensors",
                           {"tokens": tokens, "doc": doc, "lengths": lengths,
                            "labels": labels}, {"seed": str(s)})
    nlref.save_safetensors(base + ".forward.safetensors",
                           {"logits": logits.detach().float(),
                            "aux_loss": aux.detach().float()})
    nlref.save_safetensors(base + ".grads.safetensors", grads)
    print("%-6s seed %d  loss %.6f ce %.6f aux %.6f" %
          (name, s, grads["loss"], grads["ce_loss"], grads["aux_loss"]))
    return 0


# LoRA adapters (DESIGN 6) on a frozen MoE decoder: the adapters' gradients;
# lora_moe adapts every expert's w_gate, w_up, w_down too (4 experts, top 2),
# lora_dense a dense GeGLU encoder's one expert.
LORA = {"lora": (dict(_FAM), 2, 21, 6000, 4, 8.0, ("wq", "wk", "wv", "wo")),
        "lora_moe": (dict(_FAM), 2, 19, 6100, 4, 8.0,
                     ("wq", "wo", "w_gate", "w_up", "w_down")),
        "lora_dense": (dict(_FAM, num_experts=1, top_k=1, causal=False,
                            ffn_act="geglu"), 2, 17, 6200, 3, 6.0,
                       ("wv", "w_gate", "w_up", "w_down"))}


def lora_case(name, cfg_kw, batch, seq, seed, rank, alpha, targets):
    """Weights, a batch and adapters (A from normal(0, 1/r) as DESIGN
    says, B drawn too, std 0.1, so that both get gradients); the forward
    file holds the adapted logits, grads the adapters' gradients."""
    cfg, weights, tokens, targets_, used, _ = make_case(cfg_kw, batch, seq, seed)
    gen = torch.Generator().manual_seed(used + 1)
    adapters = {}
    model = nlref.NeuroLLM(cfg, weights).double()
    for p, owner, t in nlref.lora_sites(model, targets):
        base = getattr(owner, t)
        adapters[p + "lora_A.weight"] = torch.randn(
            rank, base.in_features, generator=gen) / rank
        adapters[p + "lora_B.weight"] = torch.randn(
            base.out_features, rank, generator=gen) * 0.1
    nlref.add_lora(model, rank, alpha, targets, adapters)
    loss, ce, aux, logits = nlref.forward_loss(model, tokens, targets_)
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()
             if "lora_" in n}
    grads.update(loss=loss.detach().float(), ce_loss=ce.detach().float(),
                 aux_loss=aux.detach().float())
    base = os.path.join(DATA, name)
    nlref.save_checkpoint(base + ".model.safetensors", cfg, weights)
    nlref.save_safetensors(base + ".batch.safetensors",
                           {"tokens": tokens, "targets": targets_},
                           {"seed": str(used)})
    nlref.save_safetensors(base + ".adapter.safetensors", adapters,
                           {"format": "neurollm-lora/1", "rank": str(rank),
                            "alpha": str(alpha), "targets": ",".join(targets)})
    nlref.save_safetensors(base + ".forward.safetensors",
                           {"logits": logits.detach().float(),
                            "aux_loss": aux.detach().float()})
    nlref.save_safetensors(base + ".grads.safetensors", grads)
    print("%-6s seed %d  loss %.6f (adapters %s, rank %d)" %
          (name, used, grads["loss"], ",".join(targets), rank))
    return 0


def write_case(name, cfg, weights, tokens, targets, used, doc=None):
    """Write the four files of one case; returns their sizes."""
    fwd, grads = golden(cfg, weights, tokens, targets, doc)
    base = os.path.join(DATA, name)
    nlref.save_checkpoint(base + ".model.safetensors", cfg, weights)
    batch = {"tokens": tokens, "targets": targets}
    if doc is not None:
        batch["doc"] = doc
    nlref.save_safetensors(base + ".batch.safetensors", batch,
                           {"seed": str(used)})
    nlref.save_safetensors(base + ".forward.safetensors", fwd)
    nlref.save_safetensors(base + ".grads.safetensors", grads)
    sizes = [os.path.getsize(base + s) for s in
             (".model.safetensors", ".batch.safetensors",
              ".forward.safetensors", ".grads.safetensors")]
    print("%-6s seed %d  loss %.6f ce %.6f aux %.6f  %s" %
          (name, used, grads["loss"], grads["ce_loss"], grads["aux_loss"],
           describe(cfg, weights, tokens, doc)))
    print("       bytes: model %d, batch %d, forward %d, grads %d" %
          tuple(sizes))
    return sum(sizes)


def main():
    os.makedirs(DATA, exist_ok=True)
    torch.set_num_threads(1)
    names = sys.argv[1:] or (list(CONFIGS) + list(FAMILIES) + list(CLASSIFY) +
                             list(LORA))
    total = 0
    for name in names:
        if name in CONFIGS:
            cfg_kw, batch, seq, seed = CONFIGS[name]
            total += write_case(name, *make_case(cfg_kw, batch, seq, seed))
        elif name in FAMILIES:
            cfg_kw, batch, seq, seed, docs, ignored = FAMILIES[name]
            total += write_case(name, *make_case(cfg_kw, batch, seq, seed,
                                                 docs, ignored))
        elif name in LORA:
            total += lora_case(name, *LORA[name])
        elif name in CLASSIFY:
            total += classify_case(name, *CLASSIFY[name])
        else:
            sys.exit("unknown config %s" % name)
    print("total %d bytes (%.2f MB) in %s" % (total, total / 1e6, DATA))


if __name__ == "__main__":
    main()
