#!/usr/bin/env python3
"""Hugging Face transformers' MixtralForCausalLM built from one of this
project's model configs (configs/*.yaml), timed in bf16 at the same batch and
sequence length as `neuroctl bench`, eager (attn_implementation="sdpa") and
with torch.compile: forward tokens/s and training tokens/s (forward,
backward and one AdamW step), and, with --what generate, batch-1 greedy
decode tokens/s. The baseline of issue 28's and issue 29's benchmark
(bench/gpu_check.sh runs it on the GPU machine, which has torch and
transformers but no package registry; nothing is installed by this script).

Output: one JSON line per measurement, then, with --ours (files holding
`neuroctl bench` JSON lines), one line per figure of ours and one per ratio
ours / transformers, and a closing "summary" line. Each forward and training
figure carries the fraction of the GPU's dense bf16 peak (table PEAKS_BF16,
looked up by the device's name; null where unknown or on the CPU); a decode
figure's peak_frac is always null (decode at batch 1 is bound by memory and
launches, not FLOPs).

FLOPs (the same formula for both sides, so a ratio of FLOP rates is the
ratio of tokens/s):
  N_active = L (attention + router + k experts) + V d  (head; the embedding
             lookup does no FLOPs), attention = d (H hd) + 2 d (G hd) + (H hd) d,
             an expert 3 d F;
  forward  per token = 2 N_active + 2 L H hd T   (causal scores and values:
             2 matmuls x 2 FLOP x T/2 keys x hd per head and layer);
  training per token = 3 x forward = 6 N_active + 6 L H hd T.

Decode (--what generate; once per config, batch 1, a random prompt of
--prompt-tokens P ids, greedy, `model.generate` with max_new_tokens =
min_new_tokens and no end-of-sequence id, so it never stops early): each
iteration times generate(N = --new-tokens) and generate(1) on the same
prompt; generate(1) is the prefill and the first token, so
  decode tok/s = (N - 1) / (median t_N - median t_1),
the rate of the N - 1 single-token steps without the prefill (as `neuroctl
bench`'s decode_tok_s: batch 1 after a 16-token prompt, greedy). The line
also carries `generated`, the tokens generate returned (an error unless N).
Modes: eager = the default dynamic KV cache; compile = transformers' static
KV cache (generation_config.cache_implementation = "static") and
model.forward = torch.compile(model.forward, mode="reduce-overhead",
fullgraph=True), as transformers' "Optimizing inference" guide does, each
call marked a new CUDA-graph step and its logits copied out of the graph's
memory, which the next replay overwrites (generate's own compilation of the forward is turned off where it has one,
so the forward is compiled once; where fullgraph=True fails on the model's
graph breaks it is compiled again without it, and the line says
"fullgraph": false). Where torch has no torch.compile, or transformers no
static cache for Mixtral, a compile measurement is a "skipped" line (with
the reason), not a failure. --compile-specs names a decode by its config
and prompt length (e.g. bench-large:16). A decode ratio pairs ours with
transformers of the same config, prompt length and precision (bf16).

Usage:
  bench/hf_mixtral_bench.py --spec configs/bench-large.yaml:1024 [--spec ...]
      [--batch 8] [--device cuda] [--modes eager,compile] [--compile-specs SPEC,...]
      [--what forward,train[,generate]] [--new-tokens 128] [--prompt-tokens 16]
      [--warmup 2] [--iters 5] [--ours FILE ...]
  bench/hf_mixtral_bench.py --tiny --device cpu      (a tiny config, for a CPU check)
Exit status: 0 every measurement ran (or was skipped), 1 one failed (its line
says why), 2 usage, 77 torch or transformers is not installed (the message
says which).
"""
import argparse
import functools
import json
import os
import statistics
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


def build(c, torch, transformers, device, decode=False):
    """The model in bf16 on `device`; for decode with its KV cache on and
    without the router logits (no load-balancing loss in generate's steps)."""
    theta = float(c.get("rope_base", 10000))
    kw = dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_dim"], intermediate_size=c["ffn_dim"],
        num_hidden_layers=c["num_layers"], num_attention_heads=c["num_heads"],
        num_key_value_heads=c["num_kv_heads"], head_dim=c["hidden_dim"] // c["num_heads"],
        num_local_experts=c["num_experts"], num_experts_per_tok=c["top_k"],
        max_position_embeddings=c.get("max_seq_len", 2048), rope_theta=theta,
        rms_norm_eps=float(c.get("norm_eps", 1e-6)), router_aux_loss_coef=float(c.get("aux_loss_coef", 0.01)),
        output_router_logits=not decode, tie_word_embeddings=False, use_cache=decode,
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
        rec["error"] = error_text(e)
    emit(rec)
    return rec


def error_text(e):
    return "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")


def no_compile(torch):
    """Why torch.compile cannot run here (None: it can)."""
    if not hasattr(torch, "compile"):
        return "torch %s has no torch.compile (it came with torch 2.0)" % torch.__version__
    return None


def no_static_cache(model, transformers):
    """Why transformers cannot give this model a static KV cache (None: it can)."""
    if not hasattr(transformers, "StaticCache"):
        return "transformers %s has no StaticCache" % transformers.__version__
    supports = getattr(model, "_supports_static_cache", None)  # 4.42 to 4.5x name it
    # 4.38 to 4.41: generate sets the static cache up through the model's
    # _setup_cache, which only some models (Llama, Gemma) have
    older = callable(getattr(getattr(transformers, "LlamaForCausalLM", None), "_setup_cache", None))
    if supports is False or (supports is None and older and not callable(getattr(model, "_setup_cache", None))):
        return "transformers %s has no static KV cache for %s" % (transformers.__version__, type(model).__name__)
    return None


def skipped(rec, why):
    rec["skipped"] = why
    emit(rec)
    return rec


def decode_setup(model, torch, mode, fullgraph):
    """Greedy generation that never stops early (no end-of-sequence id); in
    compile mode transformers' static KV cache and a compiled forward."""
    gc = model.generation_config
    gc.eos_token_id = None  # no early stop: min_new_tokens then needs no EOS either
    gc.pad_token_id = 0  # unused without an EOS; set, so generate does not warn
    gc.do_sample = False
    if mode == "compile":
        gc.cache_implementation = "static"
        if hasattr(gc, "disable_compile"):  # newer generate compiles the forward itself: once is enough
            gc.disable_compile = True
        if not hasattr(model, "_eager_forward"):
            model._eager_forward = model.forward
        compiled = torch.compile(model._eager_forward, mode="reduce-overhead", fullgraph=fullgraph)

        @functools.wraps(model._eager_forward)  # generate reads the signature (logits_to_keep)
        def forward(*a, **k):
            # reduce-overhead replays CUDA graphs whose outputs the next replay
            # overwrites, and generate reads a step's logits after the next step
            # began ("accessing tensor output of CUDAGraphs that has been
            # overwritten": the H200 run of 2026-11-28): each call a new step,
            # its logits copied out of the graph's memory (batch 1: one row)
            mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
            if mark is not None:
                mark()
            out = compiled(*a, **k)
            if getattr(out, "logits", None) is not None:
                out.logits = out.logits.clone()
            return out

        model.forward = forward


def decode_times(model, ids, N, args, torch):
    """Median seconds of generate(N) and of generate(1), and the tokens the
    last generate(N) returned beyond the prompt."""
    mask = torch.ones_like(ids)

    def gen(n):
        sync(torch, args.device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             use_cache=True)
        sync(torch, args.device)
        return time.perf_counter() - t0, out.shape[-1] - ids.shape[-1]

    for _ in range(args.warmup):  # N first: a static cache made for N serves 1 too
        gen(N)
        gen(1)
    tn, t1 = [], []
    for _ in range(args.iters):
        t, generated = gen(N)
        tn.append(t)
        t1.append(gen(1)[0])
    return statistics.median(tn), statistics.median(t1), generated


def measure_generate(c, name, args, mode, torch, transformers, devname):
    """One figure: batch-1 greedy decode tokens/s after a prompt of
    --prompt-tokens, without the prefill, in `mode` (eager | compile)."""
    P, N, dev = args.prompt_tokens, args.new_tokens, args.device
    rec = {"impl": "transformers", "mode": mode, "what": "generate", "config": name, "batch": 1, "seq": P,
           "new_tokens": N, "precision": "bf16", "device": devname,
           "kv_cache": "static" if mode == "compile" else "dynamic"}
    if mode == "compile" and no_compile(torch):
        return skipped(rec, no_compile(torch))
    t0 = time.perf_counter()
    try:
        model = build(c, torch, transformers, dev, decode=True)
        model.eval()
        if mode == "compile" and no_static_cache(model, transformers):
            return skipped(rec, no_static_cache(model, transformers))
        ids = torch.randint(0, c["vocab_size"], (1, P), device=dev)
        fullgraph = mode == "compile"
        decode_setup(model, torch, mode, fullgraph)
        try:
            tn, t1, generated = decode_times(model, ids, N, args, torch)
        except Exception as e:  # fullgraph=True stopped at a graph break: compile without it
            if not (fullgraph and type(e).__module__.startswith("torch._dynamo")):
                raise
            rec.update({"fullgraph": False, "fullgraph_error": error_text(e)})
            torch._dynamo.reset()
            decode_setup(model, torch, mode, False)
            tn, t1, generated = decode_times(model, ids, N, args, torch)
        else:
            if mode == "compile":
                rec["fullgraph"] = True
        rec.update({"generated": generated, "generate_ms": round(tn * 1e3, 3), "prefill_ms": round(t1 * 1e3, 3)})
        if generated != N:
            raise RuntimeError("generate returned %d new tokens, not %d" % (generated, N))
        if tn <= t1:
            raise RuntimeError("generate(%d) took %.3f ms, no longer than generate(1)'s %.3f ms: no decode rate"
                               % (N, tn * 1e3, t1 * 1e3))
        tok_s = (N - 1) / (tn - t1)
        rec.update({"tok_s": round(tok_s, 1), "ms_per_token": round(1e3 / tok_s, 3), "peak_frac": None,
                    "wall_s": round(time.perf_counter() - t0, 1)})
    except Exception as e:  # an OOM or an API change: report it, go on
        rec["error"] = error_text(e)
    emit(rec)
    return rec


def release(torch, device, mode):
    """After a measurement, its model and optimizer unreferenced: free them."""
    import gc
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    if mode == "compile" and not no_compile(torch):
        torch._dynamo.reset()


OURS_DECODE_PROMPT = 16  # neuroctl bench's decode: batch 1 after a prompt of 16 ids


def ours_figures(paths, cfgs, devname, device, whats):
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
            dec = j.get("decode_tok_s")
            if "generate" in whats and dec:
                rec = {"impl": "neurollm", "precision": j.get("precision", "fp32"), "what": "generate",
                       "config": name, "batch": 1, "seq": OURS_DECODE_PROMPT, "device": j.get("device"),
                       "kv_cache": j.get("kv_cache"), "tok_s": dec, "ms_per_token": round(1e3 / dec, 3),
                       "peak_frac": None}
                emit(rec)
                out.append(rec)
    return out


def ratios(ours, theirs):
    """ours / transformers for each figure of the same config, seq and what
    (a decode figure: also of the same precision, bf16)."""
    for o in ours:
        for t in theirs:
            if (t["config"], t["seq"], t["what"]) != (o["config"], o["seq"], o["what"]) or not t.get("tok_s"):
                continue
            if o["what"] == "generate" and o["precision"] != t["precision"]:
                continue
            emit({"ratio": "neurollm_%s/transformers_%s" % (o["precision"], t["mode"]),
                  "config": o["config"], "seq": o["seq"], "what": o["what"],
                  "value": round(o["tok_s"] / t["tok_s"], 3)})


WHATS = ("forward", "train", "generate")
MODES = ("eager", "compile")


def parse_args():
    paras = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(description=paras[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(p for p in paras if p.startswith(("Decode", "Usage"))))
    ap.add_argument("--spec", action="append", default=[], help="CONFIG.yaml:T (repeatable)")
    ap.add_argument("--batch", type=int, default=8, help="forward and training batch (decode is batch 1)")
    ap.add_argument("--device", default="cuda", help="a torch device: cuda, cuda:1, cpu (default cuda)")
    ap.add_argument("--modes", default="eager,compile",
                    help="eager and/or compile (generate: compile = static KV cache + torch.compile)")
    ap.add_argument("--compile-specs", default=None,
                    help="the specs (CONFIG_NAME:T, e.g. bench-large:1024) also timed with "
                         "torch.compile; generate's T is --prompt-tokens (e.g. bench-large:16); "
                         "default: every spec")
    ap.add_argument("--what", default="forward,train",
                    help="any of forward,train,generate (generate: batch-1 greedy decode tokens/s "
                         "without the prefill, once per config)")
    ap.add_argument("--new-tokens", type=int, default=128,
                    help="generate: tokens decoded, N >= 2; tok/s = (N-1) / (t_N - t_1)")
    ap.add_argument("--prompt-tokens", type=int, default=16,
                    help="generate: prompt length (neuroctl bench decodes after 16)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs first (generate: pairs of N and 1)")
    ap.add_argument("--iters", type=int, default=5,
                    help="timed runs: forward and training their mean, generate the median of each")
    ap.add_argument("--ours", action="append", default=[], help="a file of neuroctl bench JSON lines")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model (d 64, L 2, E 8, V 256) at T 32, named builtin-tiny")
    args = ap.parse_args()
    if not args.spec and not args.tiny:
        ap.error("give --spec CONFIG.yaml:T or --tiny")
    args.whats = [w for w in args.what.split(",") if w]
    args.modes = [m for m in args.modes.split(",") if m]
    for flag, got, known in (("--what", args.whats, WHATS), ("--modes", args.modes, MODES)):
        bad = [x for x in got if x not in known]
        if bad or not got:
            ap.error("%s %s: want a comma-separated list of %s" % (flag, ",".join(got), ", ".join(known)))
    for flag, v, lo in (("--new-tokens", args.new_tokens, 2), ("--prompt-tokens", args.prompt_tokens, 1),
                        ("--iters", args.iters, 1), ("--warmup", args.warmup, 0), ("--batch", args.batch, 1)):
        if v < lo:
            ap.error("%s %d: want at least %d" % (flag, v, lo))
    cfgs, specs = {}, []
    if args.tiny:  # not "tiny": configs/tiny.yaml, a --spec beside it, is another model
        cfgs["builtin-tiny"] = TINY
        specs.append(("builtin-tiny", 32))
    for s in args.spec:
        path, _, t = s.rpartition(":")
        if not path or not t.isdigit():
            ap.error("--spec %s: want CONFIG.yaml:T" % s)
        name = os.path.splitext(os.path.basename(path))[0]
        cfgs[name] = read_yaml(path)
        specs.append((name, int(t)))
    if "generate" in args.whats:
        for name, c in cfgs.items():
            if args.prompt_tokens + args.new_tokens > c.get("max_seq_len", 2048):
                ap.error("--prompt-tokens %d + --new-tokens %d: past %s's max_seq_len %d"
                         % (args.prompt_tokens, args.new_tokens, name, c.get("max_seq_len", 2048)))
    return args, cfgs, specs


def jobs(args, specs):
    """(config, T, whats) in the order measured: forward and training per spec,
    then decode once per config (T = the prompt)."""
    out = [(name, T, [w for w in args.whats if w != "generate"]) for name, T in specs]
    if "generate" in args.whats:
        names = []
        for name, _ in specs:
            if name not in names:
                names.append(name)
        out += [(name, args.prompt_tokens, ["generate"]) for name in names]
    return [j for j in out if j[2]]


def main():
    args, cfgs, specs = parse_args()
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
                  "flops": "train/token = 6 N_active + 6 L H hd T; forward = a third",
                  "decode": "tok/s = (N-1) / (t_N - t_1), batch 1, greedy"}})
    compiled = None if args.compile_specs is None else set(x for x in args.compile_specs.split(",") if x)
    theirs, failed = [], 0
    for name, T, whats in jobs(args, specs):
        for mode in args.modes:
            if mode == "compile" and compiled is not None and "%s:%d" % (name, T) not in compiled:
                continue
            for what in whats:
                if what == "generate":
                    r = measure_generate(cfgs[name], name, args, mode, torch, transformers, devname)
                elif mode == "compile" and no_compile(torch):
                    r = skipped({"impl": "transformers", "mode": mode, "what": what, "config": name,
                                 "batch": args.batch, "seq": T, "precision": "bf16", "device": devname},
                                no_compile(torch))
                else:
                    r = measure(cfgs[name], name, T, args, mode, what, torch, transformers, devname)
                release(torch, args.device, mode)
                failed += "error" in r
                theirs.append(r)
    ours = ours_figures(args.ours, cfgs, devname, args.device, args.whats)
    ratios(ours, theirs)
    emit({"summary": {"measurements": len(theirs), "failed": failed,
                      "skipped": sum("skipped" in r for r in theirs), "ours": len(ours)}})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
