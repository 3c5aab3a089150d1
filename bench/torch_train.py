#!/usr/bin/env python3
"""Train the reference model in PyTorch exactly as `neuroctl train` does.

    python3 bench/torch_train.py --model MODEL.safetensors --data TEXT \\
        --steps 400 --batch 16 --seq 128 --eval-every 100 --threads 2 \\
        --log torch.jsonl

The PyTorch side of the training-quality comparison (bench/quality.sh):
the same run as `neuroctl train` with the same arguments, step for step.

  * weights: the checkpoint written by `neuroctl init`, loaded with nlref;
  * data: the same file (text: bytes are ids; `.tok`: little-endian uint32
    ids), the same held-out tail (n_train = n - int(n * holdout)), and the
    same batches: core/model/rng.c (splitmix64 seeding, xoshiro256**,
    nl_rng_below) and nl_dataset_batch of core/data/data.c ported bit for bit.
    Step s trains on batch (split 0, index s); an evaluation is the mean
    cross-entropy over held-out batches (split 1, indices
    0..eval_batches-1), after every eval_every-th step and the last;
  * loss CE + aux_loss_coef * aux (nlref.loss_fn), one microbatch;
  * torch.nn.utils.clip_grad_norm_ at 1.0, then torch.optim.AdamW (betas
    0.9/0.95, eps 1e-8, weight decay 0.1 on every 2-D parameter: matrices
    and both vocabulary tables; none on norm gains). The constants and the
    learning rate are rounded to float32 first, as the C trainer holds
    them. A step whose loss or gradient norm is not finite is skipped;
  * learning rate: nl_lr_at of core/train/train.c (linear warm-up over --warmup
    steps, default steps // 10, then cosine to --min-lr, default lr / 10).

--log gets one JSON object per step: step, loss, ce_loss, aux_loss, lr,
grad_norm, tokens_per_s (the step alone, as neuroctl's), skipped, and
eval_loss where evaluated. The last stdout line is a JSON summary with the
wall time. Freed memory is kept in the heap (see tune_malloc;
--stock-malloc leaves glibc's defaults).

--print-batch SPLIT:INDEX prints that batch's token ids (one sequence a
line, ids separated by spaces) and exits: the self-check against the C
sampler.
"""

import argparse
import ctypes
import json
import math
import os
import sys
import time

try:
    import torch
except ImportError:  # a python3 without Debian's python3-torch first in PATH
    if os.path.exists("/usr/bin/python3") and os.path.realpath(
            sys.executable) != os.path.realpath("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "golden"))
import nlref  # noqa: E402

MASK64 = (1 << 64) - 1
DATA_MAX_BYTES = 4 << 30  # NL_DATA_MAX_BYTES


# ------------------------------------------------------- core/model/rng.c port --

class Rng:
    """xoshiro256** seeded through splitmix64, as nl_rng (core/model/rng.c)."""

    def __init__(self, seed, stream):
        x = (seed ^ (stream * 0xD1B54A32D192ED03)) & MASK64
        self.s = []
        for _ in range(4):
            x = (x + 0x9E3779B97F4A7C15) & MASK64
            z = x
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
            self.s.append(z ^ (z >> 31))

    @staticmethod
    def _rotl(x, k):
        return ((x << k) | (x >> (64 - k))) & MASK64

    def u64(self):
        s = self.s
        result = (self._rotl((s[1] * 5) & MASK64, 7) * 9) & MASK64
        t = (s[1] << 17) & MASK64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = self._rotl(s[3], 45)
        return result

    def below(self, n):
        """Uniform in [0, n) without modulo bias (nl_rng_below)."""
        limit = MASK64 - MASK64 % n
        while True:
            x = self.u64()
            if x < limit:
                return x % n


# ------------------------------------------------------ core/data/data.c port --

class Dataset:
    """nl_dataset: ids and the held-out split (nl_dataset_load)."""

    def __init__(self, path, vocab_size, holdout):
        if not 0.0 <= holdout <= 0.5:
            raise SystemExit("holdout: %g must be in [0, 0.5]" % holdout)
        if os.path.getsize(path) > DATA_MAX_BYTES:
            raise SystemExit("%s: larger than %d bytes" %
                             (path, DATA_MAX_BYTES))
        with open(path, "rb") as fp:
            raw = fp.read()
        if path.endswith(".tok"):
            if len(raw) % 4:
                raise SystemExit("%s: %d bytes is not a whole number of "
                                 "uint32 ids" % (path, len(raw)))
            ids = np.frombuffer(raw, dtype="<u4").astype(np.int64)
        else:
            ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
        bad = np.nonzero(ids >= vocab_size)[0]
        if bad.size:
            raise SystemExit("%s: token %d at index %d is outside the "
                             "model's vocabulary of %d" %
                             (path, ids[bad[0]], bad[0], vocab_size))
        self.ids = ids
        self.n = len(ids)
        self.n_train = self.n - int(float(self.n) * holdout)

    def batch(self, split, seed, index, b, t):
        """nl_dataset_batch: (tokens, targets) int64 [b, t]."""
        lo, hi = (self.n_train, self.n) if split else (0, self.n_train)
        if hi - lo < t + 1:
            raise SystemExit("%s data has %d tokens, fewer than one window "
                             "of %d + 1" % ("held-out" if split
                                            else "training", hi - lo, t))
        rng = Rng(seed, (0xDA7A0000 + split * 0x100000000 + index) & MASK64)
        starts = hi - lo - t
        offs = [lo + rng.below(starts) for _ in range(b)]
        win = np.stack([self.ids[o:o + t + 1] for o in offs])
        return (torch.from_numpy(win[:, :t].copy()),
                torch.from_numpy(win[:, 1:].copy()))


# ----------------------------------------------------- core/train/train.c port --

def lr_at(step, total, warmup, lr, min_lr):
    """nl_lr_at: linear warm-up, then cosine from lr to min_lr."""
    if warmup > 0 and step < warmup:
        return lr * float(step + 1) / float(warmup)
    if total - warmup <= 1:
        return lr
    progress = float(step - warmup) / float(total - warmup - 1)
    progress = min(progress, 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def f32(x):
    """x rounded to float32, as the C trainer holds its constants."""
    return float(np.float32(x))


def make_optimizer(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": f32(0.1)},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=0.0, betas=(f32(0.9), f32(0.95)), eps=f32(1e-8))


def eval_loss(model, ds, args):
    """Mean cross-entropy over the held-out batches 0..eval_batches-1."""
    total = 0.0
    with torch.no_grad():
        for i in range(args.eval_batches):
            tokens, targets = ds.batch(1, args.seed, i, args.batch, args.seq)
            logits, aux = model(tokens)
            _, ce, _ = nlref.loss_fn(logits, aux, targets, model.cfg)
            total += float(ce)
    return total / args.eval_batches


def train(model, ds, args, logf):
    opt = make_optimizer(model)
    params = list(model.parameters())
    coef = model.cfg["aux_loss_coef"]
    rows = args.batch * args.seq
    step_s, skipped, last_eval = 0.0, 0, None
    first_loss = None
    t_begin = time.perf_counter()
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.warmup, args.lr, args.min_lr)
        tokens, targets = ds.batch(0, args.seed, step, args.batch, args.seq)
        t0 = time.perf_counter()
        model.train()
        for group in opt.param_groups:
            group["lr"] = f32(lr)
        opt.zero_grad(set_to_none=False)
        logits, aux = model(tokens)
        loss, ce, aux = nlref.loss_fn(logits, aux, targets, model.cfg)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        ce_f, aux_f = float(ce), float(aux)
        loss_f = ce_f + coef * aux_f
        skip = not (math.isfinite(loss_f) and math.isfinite(norm))
        if skip:
            skipped += 1
            print("step %d: non-finite %s; step skipped" %
                  (step + 1, "gradient" if math.isfinite(loss_f)
                   else "loss"), file=sys.stderr)
        else:
            opt.step()
        dt = time.perf_counter() - t0
        step_s += dt
        if first_loss is None:
            first_loss = loss_f
        rec = {"step": step + 1, "loss": loss_f, "ce_loss": ce_f,
               "aux_loss": aux_f, "lr": lr, "grad_norm": norm,
               "tokens_per_s": round(rows / dt, 1), "skipped": skip}
        if args.eval_every > 0 and ((step + 1) % args.eval_every == 0
                                    or step + 1 == args.steps):
            last_eval = rec["eval_loss"] = eval_loss(model, ds, args)
        line = "step %d/%d | loss %.4f | %.0f tok/s | lr %.2e" % (
            step + 1, args.steps, loss_f, rows / dt, lr)
        if "eval_loss" in rec:
            line += " | eval %.4f" % rec["eval_loss"]
        print(line, file=sys.stderr)
        if logf:
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
    wall = time.perf_counter() - t_begin
    return {"steps": args.steps, "first_loss": first_loss,
            "final_eval_loss": last_eval, "skipped": skipped,
            "train_wall_s": round(wall, 3), "step_s": round(step_s, 3),
            "tokens_per_s": round(args.steps * rows / step_s, 1)}


def tune_malloc():
    """Keep freed memory in the heap (glibc mallopt), as PyTorch's CPU
    tuning guide does with jemalloc or tcmalloc. With glibc's defaults every
    step's multi-megabyte activations are mmap'd or trimmed back to the
    system and fault their pages in again: element-wise ops then ran 3-10x
    slower here. False where mallopt is unavailable (not glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return (libc.mallopt(-3, 32 << 20) == 1  # M_MMAP_THRESHOLD: 32 MiB
                and libc.mallopt(-1, 1 << 30) == 1)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def parse_args():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True,
                    help="checkpoint to start from (from neuroctl init)")
    ap.add_argument("--data", required=True,
                    help="text (bytes are ids) or .tok (uint32 LE ids)")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min-lr", type=float, default=None,
                    help="default lr / 10")
    ap.add_argument("--warmup", type=int, default=None,
                    help="default steps // 10")
    ap.add_argument("--seed", type=int, default=0, help="data-order seed")
    ap.add_argument("--holdout", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--log", help="write one JSON object per step here")
    ap.add_argument("--stock-malloc", action="store_true",
                    help="leave glibc's malloc thresholds at their defaults")
    ap.add_argument("--print-batch", metavar="SPLIT:INDEX",
                    help="print that batch's token ids and exit")
    args = ap.parse_args()
    if min(args.batch, args.seq, args.threads, args.eval_batches) < 1:
        ap.error("batch, seq, threads and eval-batches must be >= 1")
    if not 0 <= args.seed <= MASK64 >> 1:
        ap.error("seed must be in 0..2^63-1")
    if not args.print_batch and args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.eval_every < 0 or (args.warmup is not None and args.warmup < 0):
        ap.error("eval-every and warmup must be >= 0")
    if args.eval_every > 0 and args.holdout <= 0.0:
        ap.error("--eval-every needs held-out data (--holdout > 0)")
    if args.warmup is None:
        args.warmup = args.steps // 10
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    return args


def main():
    args = parse_args()
    cfg, weights, _ = nlref.load_checkpoint(args.model)
    if args.seq > cfg["max_seq_len"]:
        raise SystemExit("--seq %d exceeds max_seq_len %d" %
                         (args.seq, cfg["max_seq_len"]))
    ds = Dataset(args.data, cfg["vocab_size"], args.holdout)
    if args.print_batch:
        split, _, index = args.print_batch.partition(":")
        tokens, _ = ds.batch(int(split), args.seed, int(index or 0),
                             args.batch, args.seq)
        for row in tokens.tolist():
            print(" ".join(map(str, row)))
        return
    malloc_tuned = not args.stock_malloc and tune_malloc()
    torch.set_num_threads(args.threads)
    model = nlref.NeuroLLM(cfg, weights)
    print("training %d parameters on %d tokens (%d held out): %d steps of "
          "%d x %d, %d threads" %
          (sum(p.numel() for p in model.parameters()), ds.n_train,
           ds.n - ds.n_train, args.steps, args.batch, args.seq,
           args.threads), file=sys.stderr)
    logf = open(args.log, "w", encoding="utf-8") if args.log else None
    try:
        summary = train(model, ds, args, logf)
    finally:
        if logf:
            logf.close()
    summary.update({"batch": args.batch, "seq": args.seq,
                    "threads": args.threads, "malloc_tuned": malloc_tuned,
                    "torch": torch.__version__})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
