#!/usr/bin/env bash
# Training quality across growth (issue 16's benchmark, DESIGN section 5):
# a model half the final size trains N steps, grows (depth: 2 -> 4 layers;
# separately width: d 64 -> 128 with F 128 -> 256), and trains N more, on
# the learning-rate schedule of a 2N-step run throughout. Compared with the
# final size trained from scratch for 2N steps and with the un-grown model
# trained for 2N steps, by held-out loss; also the growth's own cost in
# seconds (`neuroctl grow`: load, grow with the moments, save). Prints one
# JSON summary; writes OUT/grow_quality.png when matplotlib is there.
#   bench/grow_quality.sh [BUILD_DIR] [N]
# Settings (environment, with defaults): CONFIG=configs/tiny.yaml (the final
# size) BATCH=8 SEQ=64 LR=1e-3 THREADS=2 EVAL_EVERY=N/5 EVAL_BATCHES=8
# OUT=BUILD_DIR/grow_quality (data, checkpoints and logs are kept).
# Needs the `fortunes` package (the text of bench/quality.sh) and a built
# BUILD_DIR (default: build).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build}
N=${2:-200}
CONFIG=${CONFIG:-$ROOT/configs/tiny.yaml}
BATCH=${BATCH:-8}
SEQ=${SEQ:-64}
LR=${LR:-1e-3}
THREADS=${THREADS:-2}
EVAL_EVERY=${EVAL_EVERY:-$((N / 5 > 0 ? N / 5 : 1))}
EVAL_BATCHES=${EVAL_BATCHES:-8}
OUT=${OUT:-$BUILD/grow_quality}
NEUROCTL="$BUILD/cli/neuroctl"
FORTUNES=/usr/share/games/fortunes
PY=python3
[ -x /usr/bin/python3 ] && PY=/usr/bin/python3
[ -x "$NEUROCTL" ] || { echo "no $NEUROCTL: build first (cmake --build $BUILD)" >&2; exit 1; }
[ -d "$FORTUNES" ] || { echo "no $FORTUNES: apt-get install fortunes" >&2; exit 1; }
rm -rf "$OUT"
mkdir -p "$OUT"

# the data: every fortune, in a fixed shuffled order (as bench/quality.sh)
"$PY" - "$FORTUNES" "$OUT/fortunes.txt" <<'EOF'
import os, random, sys
src, dst = sys.argv[1], sys.argv[2]
names = sorted(n for n in os.listdir(src)
               if not n.endswith((".dat", ".pdat", ".u8"))
               and os.path.isfile(os.path.join(src, n))
               and not os.path.islink(os.path.join(src, n)))
fortunes = []
for name in names:
    with open(os.path.join(src, name), "rb") as fp:
        fortunes += [f.strip(b"\n") + b"\n" for f in fp.read().split(b"\n%\n") if f.strip()]
random.Random(20240601).shuffle(fortunes)
open(dst, "wb").write(b"%\n".join(fortunes))
EOF

# the three configs: final (CONFIG), half depth, half width
"$PY" - "$CONFIG" "$OUT" <<'EOF'
import re, sys
cfg, out = sys.argv[1], sys.argv[2]
text = open(cfg).read()
def get(key):
    return int(re.search(r"^%s:\s*(\d+)" % key, text, re.M).group(1))
def put(t, key, v):
    return re.sub(r"^(%s:\s*)\d+" % key, r"\g<1>%d" % v, t, flags=re.M)
open(out + "/final.yaml", "w").write(text)
open(out + "/shallow.yaml", "w").write(put(text, "num_layers", get("num_layers") // 2))
narrow = text
for k in ("hidden_dim", "num_heads", "num_kv_heads", "ffn_dim"):
    narrow = put(narrow, k, get(k) // 2)
open(out + "/narrow.yaml", "w").write(narrow)
EOF
D=$(awk '/^hidden_dim:/ {print $2}' "$CONFIG")
F=$(awk '/^ffn_dim:/ {print $2}' "$CONFIG")
L=$(awk '/^num_layers:/ {print $2}' "$CONFIG")

COMMON=(--data "$OUT/fortunes.txt" --steps $((2 * N)) --batch "$BATCH" --seq "$SEQ" --lr "$LR"
        --holdout 0.1 --eval-every "$EVAL_EVERY" --eval-batches "$EVAL_BATCHES"
        --threads "$THREADS" --progress-every 60)
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f\n", b - a }'; }

# $1: name, $2: config; 2N steps from scratch, a checkpoint at N
scratch() {
    echo "train $1: $((2 * N)) steps of $BATCH x $SEQ" >&2
    "$NEUROCTL" init --config "$OUT/$2.yaml" --out "$OUT/$1.init.safetensors" --seed 0 >&2
    "$NEUROCTL" train --model "$OUT/$1.init.safetensors" "${COMMON[@]}" --log "$OUT/$1.jsonl" \
        --checkpoint-every "$N" --checkpoint-dir "$OUT/$1.ckpt" --out "$OUT/$1.safetensors" \
        2>"$OUT/$1.stderr"
}
# $1: name, $2: the run grown from, then the growth flags; prints its cost
grown() {
    local name=$1 from=$2
    shift 2
    local at
    at=$(printf "%s/%s.ckpt/step-%06d.safetensors" "$OUT" "$from" "$N")
    local t0 t1
    t0=$(now)
    "$NEUROCTL" grow --model "$at" --out "$OUT/$name.at-n.safetensors" "$@" >&2
    t1=$(now)
    secs "$t0" "$t1" >"$OUT/$name.grow_s"
    # the first N steps are the un-grown run's: the log starts with them
    head -n "$N" "$OUT/$from.jsonl" >"$OUT/$name.jsonl"
    echo "train $name: steps $((N + 1))..$((2 * N)) after growing ($*)" >&2
    "$NEUROCTL" train --resume "$OUT/$name.at-n.safetensors" "${COMMON[@]}" \
        --log "$OUT/$name.jsonl" --checkpoint-dir "$OUT/$name.ckpt" \
        --out "$OUT/$name.safetensors" 2>"$OUT/$name.stderr"
}

scratch final final
scratch shallow shallow
scratch narrow narrow
grown deepened shallow --layers "$L"
grown widened narrow --hidden-dim "$D" --ffn-dim "$F"

"$PY" - "$OUT" "$N" "$BATCH" "$SEQ" "$LR" "$THREADS" "$CONFIG" <<'EOF'
import json, os, sys
out, n, batch, seq, lr, threads, config = sys.argv[1:8]
n = int(n)
def evals(name):
    rows = [json.loads(l) for l in open(os.path.join(out, name + ".jsonl")) if l.strip()]
    return {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}, rows
runs = {}
for name in ("final", "shallow", "narrow", "deepened", "widened"):
    ev, rows = evals(name)
    wall = sum(int(batch) * int(seq) / r["tokens_per_s"] for r in rows if r.get("tokens_per_s"))
    runs[name] = {"final_eval_loss": round(ev[max(ev)], 4),
                  "evals": {s: round(v, 4) for s, v in sorted(ev.items())},
                  "train_s": round(wall, 1)}
for name in ("deepened", "widened"):
    runs[name]["grow_s"] = float(open(os.path.join(out, name + ".grow_s")).read())
    # the loss just before and just after growing (training loss: no spike?)
    rows = [json.loads(l) for l in open(os.path.join(out, name + ".jsonl")) if l.strip()]
    runs[name]["train_loss_at_n"] = round(rows[n - 1]["loss"], 4)
    runs[name]["train_loss_after_n"] = round(rows[n]["loss"], 4)
res = {"bench": "grow_quality", "config": os.path.basename(config), "n": n,
       "steps": 2 * n, "batch": int(batch), "seq": int(seq), "lr": float(lr),
       "threads": int(threads), "runs": runs,
       "compare": {
           "deepened_vs_final_from_scratch": round(runs["deepened"]["final_eval_loss"] -
                                                   runs["final"]["final_eval_loss"], 4),
           "deepened_vs_shallow_ungrown": round(runs["deepened"]["final_eval_loss"] -
                                                runs["shallow"]["final_eval_loss"], 4),
           "widened_vs_final_from_scratch": round(runs["widened"]["final_eval_loss"] -
                                                  runs["final"]["final_eval_loss"], 4),
           "widened_vs_narrow_ungrown": round(runs["widened"]["final_eval_loss"] -
                                              runs["narrow"]["final_eval_loss"], 4)}}
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, grown, small, what in ((axes[0], "deepened", "shallow", "depth"),
                                   (axes[1], "widened", "narrow", "width")):
        for name, style in ((grown, "-o"), ("final", "--s"), (small, ":^")):
            ev = runs[name]["evals"]
            ax.plot(list(ev), list(ev.values()), style, label=name)
        ax.axvline(n, color="grey", lw=0.8)
        ax.set_title("grow %s at step %d" % (what, n))
        ax.set_xlabel("step")
        ax.legend()
    axes[0].set_ylabel("held-out loss")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "grow_quality.png"), dpi=100)
    res["plot"] = os.path.join(out, "grow_quality.png")
except ImportError:
    res["plot"] = None
print(json.dumps(res, indent=1))
EOF
