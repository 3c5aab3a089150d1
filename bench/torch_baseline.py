#!/usr/bin/env python3
"""PyTorch CPU speed anchor for a NeuroLLM config (DESIGN section 4).

    python3 bench/torch_baseline.py --config configs/bench-small.yaml \\
        --batch 8 --seq 256 --threads 2 --steps 5 [--mode eager|compile] [--sweep]

Any PyTorch works: Debian's python3-torch (1.13, eager only) or a current
one in a virtual environment (benchmarks only, never in CI: it is large):
    python3 -m venv tmp/venv-torch
    tmp/venv-torch/bin/pip install numpy torch --index-url \\
        https://download.pytorch.org/whl/cpu   # or plain `pip install numpy torch`
    tmp/venv-torch/bin/python bench/torch_baseline.py ... --mode compile --sweep
--mode compile wraps the model in torch.compile (PyTorch >= 2; the first
calls, which compile, are warm-up and not timed). --sweep runs the
measurement once per OpenMP setting (OMP_WAIT_POLICY unset, PASSIVE,
ACTIVE; KMP_BLOCKTIME 0 and default), each in a fresh process since the
runtime reads them at start, and reports the best of each figure with the
setting that gave it.

Builds the DESIGN section 2 model in float32 with the DESIGN init (the
reference model of tests/golden/nlref.py: sparse expert dispatch, KV cache)
and measures, with torch.set_num_threads(threads):
  forward  no_grad forward of a [batch, seq] batch; batch*seq tokens / median
           time of `steps` calls after warm-up;
  decode   batch 1: prefill a 16-token prompt, then greedy one-token steps
           with the KV cache; new tokens / time of those steps (median of
           `steps` runs after warm-up);
  train    forward + loss (CE + aux) + backward + clip_grad_norm(1.0) + AdamW
           (lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on
           matrices only); batch*seq tokens / median step time.
Prints one JSON line. Run by hand, never as a timed test.
"""

import argparse
import json
import os
import statistics
import sys
import time

try:
    import torch
except ImportError:  # a python3 without Debian's python3-torch first in PATH
    if os.path.exists("/usr/bin/python3") and os.path.realpath(
            sys.executable) != os.path.realpath("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "golden"))
import nlref  # noqa: E402

PROMPT = 16


def parse_scalar(text):
    """A YAML plain or quoted scalar as int, float or str."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def read_flat_yaml(path):
    """Parse a flat `key: value` YAML mapping with # comments."""
    out = {}
    with open(path, encoding="utf-8") as fp:
        for n, line in enumerate(fp, 1):
            body = line.rstrip("\n")
            if body.lstrip().startswith("#") or not body.strip():
                continue
            hash_at = body.find(" #")
            if hash_at >= 0:
                body = body[:hash_at]
            if body[0] in " \t" or ":" not in body:
                raise SystemExit("%s:%d: expected a flat 'key: value' line" %
                                 (path, n))
            key, _, value = body.partition(":")
            key, value = key.strip(), value.strip()
            if not value or key in out:
                raise SystemExit("%s:%d: %s for key %r" %
                                 (path, n, "duplicate" if key in out
                                  else "no value", key))
            out[key] = parse_scalar(value)
    return out


def load_config(path):
    raw = read_flat_yaml(path)
    model_kw = {}
    for key, value in raw.items():
        if key in nlref.CONFIG_KEYS:
            model_kw[key] = value
        else:
            print("%s: ignoring non-model key %r" % (path, key),
                  file=sys.stderr)
    try:
        return nlref.make_config(**model_kw)
    except ValueError as exc:
        raise SystemExit("%s: %s" % (path, exc))


def median_time(fn, steps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_forward(model, tokens, steps, warmup):
    model.eval()

    def run():
        with torch.no_grad():
            model(tokens)
    return tokens.numel() / median_time(run, steps, warmup)


def bench_decode(model, cfg, new_tokens, steps, gen):
    model.eval()
    prompt = torch.randint(0, cfg["vocab_size"], (1, PROMPT), generator=gen)

    def run():
        caches = [{} for _ in range(cfg["num_layers"])]
        with torch.no_grad():
            logits, _ = model(prompt, caches)
            nxt = logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(new_tokens):
                logits, _ = model(nxt, caches)
                nxt = logits[:, -1:].argmax(-1)
            return time.perf_counter() - t0

    run()
    return new_tokens / statistics.median(run() for _ in range(steps))


def bench_train(model, cfg, tokens, targets, steps, warmup):
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8)

    def run():
        opt.zero_grad(set_to_none=True)
        logits, aux = model(tokens)
        loss, _, _ = nlref.loss_fn(logits, aux, targets, cfg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return tokens.numel() / median_time(run, steps, warmup)


SWEEP = [{}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "ACTIVE"},
         {"KMP_BLOCKTIME": "0"}, {"OMP_WAIT_POLICY": "PASSIVE",
                                  "KMP_BLOCKTIME": "0"}]
FIGURES = ("torch_forward_tok_s", "torch_decode_tok_s", "torch_train_tok_s")


def sweep(argv):
    """Run this script once per SWEEP setting; the best of each figure."""
    import subprocess
    best, runs = {}, []
    for env_add in SWEEP:
        env = dict(os.environ)
        env.update(env_add)
        child = [a for a in argv if a != "--sweep"]
        out = subprocess.run([sys.executable, os.path.abspath(__file__)] +
                             child, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            print("setting %s failed: %s" % (env_add, out.stderr[-400:]),
                  file=sys.stderr)
            continue
        res = json.loads(out.stdout.strip().splitlines()[-1])
        runs.append({"env": env_add, **{k: res[k] for k in FIGURES}})
        for k in FIGURES:
            if res[k] is not None and (k not in best or res[k] > best[k][0]):
                best[k] = (res[k], env_add)
        last = res
    if not runs:
        raise SystemExit("every setting failed")
    for k in FIGURES:
        last[k] = best[k][0] if k in best else None
        last[k + "_env"] = best[k][1] if k in best else None
    last["sweep"] = runs
    print(json.dumps(last))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="flat YAML model config")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=5,
                    help="timed repetitions of each measurement")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=("eager", "compile"), default="eager",
                    help="eager (default) or torch.compile (PyTorch >= 2)")
    ap.add_argument("--sweep", action="store_true",
                    help="best of several OpenMP settings, one process each")
    args = ap.parse_args()
    if args.sweep:
        return sweep(sys.argv[1:])
    if min(args.batch, args.seq, args.threads, args.steps,
           args.decode_tokens) < 1:
        raise SystemExit("batch, seq, threads, steps, decode-tokens must be "
                         ">= 1")
    cfg = load_config(args.config)
    if max(args.seq, PROMPT + args.decode_tokens) > cfg["max_seq_len"]:
        raise SystemExit("seq or prompt + decode-tokens exceeds max_seq_len "
                         "%d" % cfg["max_seq_len"])
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    model = nlref.NeuroLLM(cfg, nlref.init_weights(cfg, gen))
    tokens = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq),
                           generator=gen)
    targets = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq),
                            generator=gen)
    run_model, warmup = model, 2
    if args.mode == "compile":
        if not hasattr(torch, "compile"):
            raise SystemExit("--mode compile: torch %s has no torch.compile" %
                             torch.__version__)
        run_model, warmup = torch.compile(model), 3
    fwd = bench_forward(run_model, tokens, args.steps, warmup)
    dec = None
    try:  # the KV cache's growing shapes recompile; eager decode if it fails
        dec = bench_decode(run_model, cfg, args.decode_tokens, args.steps,
                           gen)
    except Exception as exc:  # noqa: BLE001 (any compiler failure)
        print("decode under %s failed: %s" % (args.mode, exc),
              file=sys.stderr)
    trn = bench_train(run_model, cfg, tokens, targets, args.steps, warmup)
    print(json.dumps({
        "torch_forward_tok_s": round(fwd, 1),
        "torch_decode_tok_s": round(dec, 1) if dec is not None else None,
        "mode": args.mode,
        "env": {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME")
                if k in os.environ},
        "torch_train_tok_s": round(trn, 1),
        "threads": args.threads,
        "config": args.config,
        "batch": args.batch, "seq": args.seq, "steps": args.steps,
        "decode_tokens": args.decode_tokens,
        "params": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "model": cfg,
    }))


if __name__ == "__main__":
    main()
