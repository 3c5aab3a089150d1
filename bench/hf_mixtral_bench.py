#!/usr/bin/env python3
"""Hugging Face transformers' MixtralForCausalLM built from one of this
project's model configs (configs/*.yaml), timed in bf16 at the same batch and
sequence length as `neuroctl bench`, eager (attn_implementation="sdpa") and
with torch.compile: forward tokens/s and training tokens/s (forward,
backward and one AdamW step). The baseline of issue 28's benchmark
(bench/gpu_check.sh runs it on the GPU machine, which has torch and
transformers but no package registry; nothing is installed by this script).

Output: one JSON line per measurement, then, with --ours (files holding
`neuroctl bench` JSON lines), one line per figure of ours and one per ratio
ours / transformers, and a closing "summary" line. Each figure carries the
fraction of the GPU's dense bf16 peak (table PEAKS_BF16, looked up by the
device's name; null where unknown or on the CPU).

FLOPs (the same formula for both sides, so a ratio of FLOP rates is the
ratio of tokens/s):
  N_active = L (attention + router + k experts) + V d  (head; the embedding
             lookup does no FLOPs), attention = d (H hd) + 2 d (G hd) + (H hd) d,
             an expert 3 d F;
  forward  per token = 2 N_active + 2 L H hd T   (causal scores and values:
             2 matmuls x 2 FLOP x T/2 keys x hd per head and layer);
  training per token = 3 x forward = 6 N_active + 6 L H hd T.

Usage:
  bench/hf_mixtral_bench.py --spec configs/bench-large.yaml:1024 [--spec ...]
      [--batch 8] [--device cuda] [--modes eager,compile] [--compile-specs SPEC,...]
      [--what forward,train] [--warmup 2] [--iters 5] [--ours FILE ...]
  bench/hf_mixtral_bench.py --tiny --device cpu      (a tiny config, for a CPU check)
Exit status: 0 every measurement ran, 1 one failed (its line says why),
2 usage, 77 torch or transformers is not installed (the message says which).
"""
import argparse
import json
import os
import sys
import time

# Dense bf16 tensor-core peaks, FLOP/s (NVIDIA's data sheets, without
# sparsity), by a substring of the device name; the first match wins.
PEAKS_BF16 = [
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM5 (the "H100 80GB HBM3")
    ("H800", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
]

TINY = {"vocab_size": 256, "hidden_dim": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "ffn_dim": 128, "num_experts": 8, "top_k": 2, "max_seq_len": 128, "rope_base": 10000,
        "norm_eps": 1e-6, "aux_loss_coef": 0.01}


def read_yaml(path):
    """The flat `key: value  # comment` files of configs/ (PyYAML where present)."""
    try:
        import yaml  # noqa: F401
        with open(path) as f:
            return yaml.safe_load(f)
    except ImportError:
        pass
    out = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line or ":" not in line:
                continue
            k, v = (x.strip() for x in line.split(":", 1))
            for conv in (int, float):
                try:
                    v = conv(v)
                    break
                except ValueError:
                    pass
            out[k] = v
    return out


def flops_per_token(c, T):
    d, L, H, G = c["hidden_dim"], c["num_layers"], c["num_heads"], c["num_kv_heads"]
    hd = d // H
    attn = d * H * hd + 2 * d * G * hd + H * hd * d
    active = L * (attn + d * c["num_experts"] + c["top_k"] * 3 * d * c["ffn_dim"]) + c["vocab_size"] * d
    fwd = 2 * active + 2 * L * H * hd * T
    return active, fwd, 3 * fwd


def peak_of(name):
    for key, peak in PEAKS_BF16:
        if key.lower() in (name or "").lower():
            return peak
    return None


def emit(obj):
    print(json.dumps(obj), flush=True)


def attention(torch):
    """sdpa, the anchor's attention; eager where torch is older than
    transformers' SDPA wants (2.1.1: Debian 12's 1.13, which the test
    command's tiny case runs on)."""
    v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:3] if x.isdigit())
    return "sdpa" if v >= (2, 1, 1) else "eager"


def build(c, torch, transformers, device):
    theta = float(c.get("rope_base", 10000))
    kw = dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_dim"], intermediate_size=c["ffn_dim"],
        num_hidden_layers=c["num_layers"], num_attention_heads=c["num_heads"],
        num_key_value_heads=c["num_kv_heads"], head_dim=c["hidden_dim"] // c["num_heads"],
        num_local_experts=c["num_experts"], num_experts_per_tok=c["top_k"],
        max_position_embeddings=c.get("max_seq_len", 2048), rope_theta=theta,
        rms_norm_eps=float(c.get("norm_eps", 1e-6)), router_aux_loss_coef=float(c.get("aux_loss_coef", 0.01)),
        output_router_logits=True, tie_word_embeddings=False, use_cache=False,
        attn_implementation=attention(torch))
    try:
        cfg = transformers.MixtralConfig(**kw)
    except TypeError:  # a version without these keywords: set them as attributes
        for k in ("head_dim", "rope_theta", "attn_implementation"):
            kw.pop(k)
        cfg = transformers.MixtralConfig(**kw)
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta}
        cfg._attn_implementation = attention(torch)
    torch.manual_seed(0)
    if hasattr(torch.device(device), "__enter__"):  # torch >= 2.0: made on the device
        with torch.device(device):
            model = transformers.MixtralForCausalLM(cfg)
    else:  # older torch (Debian 12's 1.13): made on the host, then moved
        model = transformers.MixtralForCausalLM(cfg).to(device)
    return model.to(dtype=torch.bfloat16)


def sync(torch, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_loop(fn, torch, device, warmup, iters):
    for _ in range(warmup):
        fn()
    sync(torch, device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(torch, device)
    return (time.perf_counter() - t0) / iters


def measure(c, name, T, args, mode, what, torch, transformers, devname):
    """One figure: tokens/s of `what` (forward | train) in `mode` (eager | compile)."""
    B, dev = args.batch, args.device
    rec = {"impl": "transformers", "mode": mode, "what": what, "config": name, "batch": B, "seq": T,
           "precision": "bf16", "device": devname}
    try:
        model = build(c, torch, transformers, dev)
        run = torch.compile(model) if mode == "compile" else model
        ids = torch.randint(0, c["vocab_size"], (B, T), device=dev)
        if what == "forward":
            model.eval()

            def fn():
                with torch.no_grad():
                    run(input_ids=ids, use_cache=False)
        else:
            model.train()
            # fused AdamW on CUDA (torch >= 2.0 takes the keyword)
            fused = {"fused": True} if dev.startswith("cuda") else {}
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)

            def fn():
                out = run(input_ids=ids, labels=ids, use_cache=False)
                out.loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        s = time_loop(fn, torch, dev, args.warmup, args.iters)
        active, fwd, train = flops_per_token(c, T)
        tok_s = B * T / s
        fl = (fwd if what == "forward" else train) * tok_s
        peak = peak_of(devname) if dev.startswith("cuda") else None
        rec.update({"tok_s": round(tok_s, 1), "step_ms": round(s * 1e3, 3),
                    "tflops": round(fl / 1e12, 2), "peak_frac": round(fl / peak, 4) if peak else None,
                    "active_params": active, "wall_s": round(time.perf_counter() - t0, 1)})
    except Exception as e:  # an OOM or an API change: report it, go on
        rec["error"] = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
    emit(rec)
    return rec


def release(torch, device, mode):
    """After a measurement, its model and optimizer unreferenced: free them."""
    import gc
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    if mode == "compile":
        torch._dynamo.reset()


def ours_figures(paths, specs, cfgs, devname, device):
    """neuroctl bench's JSON lines, as figures comparable to ours."""
    out = []
    for p in paths:
        try:
            lines = open(p).read().splitlines()
        except OSError as e:
            emit({"impl": "neurollm", "file": p, "error": str(e)})
            continue
        for line in lines:
            if not line.startswith("{"):
                continue
            j = json.loads(line)
            name = os.path.splitext(os.path.basename(j.get("config", "")))[0]
            if name not in cfgs:
                continue
            T = j.get("seq")
            peak = peak_of(devname) if device.startswith("cuda") else None
            for what in ("forward", "train"):
                tok = j.get(what + "_tok_s")
                if not tok:
                    continue
                _, fwd, train = flops_per_token(cfgs[name], T)
                fl = (fwd if what == "forward" else train) * tok
                rec = {"impl": "neurollm", "precision": j.get("precision", "fp32"), "what": what,
                       "config": name, "batch": j.get("batch"), "seq": T, "device": j.get("device"),
                       "tok_s": tok, "tflops": round(fl / 1e12, 2),
                       "peak_frac": round(fl / peak, 4) if peak else None}
                emit(rec)
                out.append(rec)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", action="append", default=[], help="CONFIG.yaml:T (repeatable)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--compile-specs", default=None,
                    help="the specs (CONFIG_NAME:T, e.g. bench-large:1024) also timed with "
                         "torch.compile; default: every spec")
    ap.add_argument("--what", default="forward,train")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--ours", action="append", default=[], help="a file of neuroctl bench JSON lines")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (d 64, L 2, E 8, V 256) at T 32")
    args = ap.parse_args()
    if not args.spec and not args.tiny:
        ap.error("give --spec CONFIG.yaml:T or --tiny")
    cfgs, specs = {}, []
    if args.tiny:
        cfgs["tiny"] = TINY
        specs.append(("tiny", 32))
    for s in args.spec:
        path, _, t = s.rpartition(":")
        if not path or not t.isdigit():
            ap.error("--spec %s: want CONFIG.yaml:T" % s)
        name = os.path.splitext(os.path.basename(path))[0]
        cfgs[name] = read_yaml(path)
        specs.append((name, int(t)))
    for name, T in specs:  # the FLOP model, before any import (also without torch)
        active, fwd, train = flops_per_token(cfgs[name], T)
        emit({"config": name, "seq": T, "active_params": active, "forward_flops_per_token": fwd,
              "train_flops_per_token": train})
    try:
        import torch
    except ImportError as e:
        print("hf_mixtral_bench: torch is not installed here (%s); nothing measured" % e, file=sys.stderr)
        return 77
    try:
        import transformers
    except ImportError as e:
        print("hf_mixtral_bench: transformers is not installed here (%s); nothing measured" % e,
              file=sys.stderr)
        return 77
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("hf_mixtral_bench: --device %s but torch sees no CUDA device" % args.device, file=sys.stderr)
        return 1
    devname = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    emit({"env": {"torch": torch.__version__, "transformers": transformers.__version__,
                  "device": devname, "peak_bf16_tflops": (peak_of(devname) or 0) / 1e12 or None,
                  "flops": "train/token = 6 N_active + 6 L H hd T; forward = a third"}})
    modes = [m for m in args.modes.split(",") if m]
    compiled = None if args.compile_specs is None else set(x for x in args.compile_specs.split(",") if x)
    theirs, failed = [], 0
    for name, T in specs:
        for mode in modes:
            if mode == "compile" and compiled is not None and "%s:%d" % (name, T) not in compiled:
                continue
            for what in args.what.split(","):
                r = measure(cfgs[name], name, T, args, mode, what, torch, transformers, devname)
                release(torch, args.device, mode)
                failed += "error" in r
                theirs.append(r)
    ours = ours_figures(args.ours, specs, cfgs, devname, args.device)
    for o in ours:
        for t in theirs:
            if (t["config"], t["seq"], t["what"]) == (o["config"], o["seq"], o["what"]) and t.get("tok_s"):
                emit({"ratio": "neurollm_%s/transformers_%s" % (o["precision"], t["mode"]),
                      "config": o["config"], "seq": o["seq"], "what": o["what"],
                      "value": round(o["tok_s"] / t["tok_s"], 3)})
    emit({"summary": {"measurements": len(theirs), "failed": failed, "ours": len(ours)}})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
