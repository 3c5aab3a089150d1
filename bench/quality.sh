#!/usr/bin/env bash
# Training quality: the same small model trained on the same English text
# with the same steps and batches by `neuroctl train` and by PyTorch
# (bench/torch_train.py), one after the other; prints one JSON summary.
#   bench/quality.sh [BUILD_DIR] [STEPS]
# Settings (environment, with defaults): CONFIG=configs/tiny.yaml BATCH=16
# SEQ=128 LR=1e-3 THREADS=2 SEED=0 EVAL_EVERY=100 EVAL_BATCHES=16
# NOISE_SEEDS=2 OUT=BUILD_DIR/quality (data, checkpoints and logs are kept).
# BF16=1 adds one more `neuroctl train` run, the main run's seeds with
# `--precision bf16` (issue 21): its held-out loss is judged against the
# FP32 run and the seed-to-seed spread (needs a CPU with AVX-512 BF16).
# TORCH=0 leaves the PyTorch run out (the summary then has no "torch" side).
# WIRE=1 adds two runs of the main run's seeds on a local two-node cluster
# (`neuroctl cluster up --nodes 2`, THREADS/2 threads each), one with
# `--wire fp32` and one with `--wire bf16` (issue 30): the bf16 wire's
# held-out loss is judged against the FP32 wire's and the seed spread.
# NOISE_SEEDS extra `neuroctl train` runs, each with its own init and data
# seed, give the run-to-run spread the difference is judged against.
# Needs the `fortunes` package, a built BUILD_DIR (default: build) and
# Debian's python3-torch (/usr/bin/python3).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build}
STEPS=${2:-400}
CONFIG=${CONFIG:-$ROOT/configs/tiny.yaml}
BATCH=${BATCH:-16}
SEQ=${SEQ:-128}
LR=${LR:-1e-3}
THREADS=${THREADS:-2}
SEED=${SEED:-0}
EVAL_EVERY=${EVAL_EVERY:-100}
EVAL_BATCHES=${EVAL_BATCHES:-16}
NOISE_SEEDS=${NOISE_SEEDS:-2}
BF16=${BF16:-0}
WIRE=${WIRE:-0}
TORCH=${TORCH:-1}
OUT=${OUT:-$BUILD/quality}
PY=/usr/bin/python3
NEUROCTL="$BUILD/cli/neuroctl"
FORTUNES=/usr/share/games/fortunes
[ -x "$NEUROCTL" ] || { echo "no $NEUROCTL: build first (cmake --build $BUILD)" >&2; exit 1; }
mkdir -p "$OUT"

# The data: every fortune text file (not the .dat/.pdat indexes or the .u8
# links), split into fortunes at lines that are a single '%', shuffled with
# a fixed seed and joined with '%' lines into one text file. --holdout 0.1
# keeps its last 10% of bytes for evaluation.
"$PY" - "$FORTUNES" "$OUT/fortunes.txt" <<'EOF' >"$OUT/data.json"
import json, math, os, random, sys
src, dst = sys.argv[1], sys.argv[2]
names = sorted(n for n in os.listdir(src)
               if not n.endswith((".dat", ".pdat", ".u8"))
               and os.path.isfile(os.path.join(src, n))
               and not os.path.islink(os.path.join(src, n)))
if not names:
    sys.exit("no fortune files in %s (apt-get install fortunes)" % src)
fortunes = []
for name in names:
    with open(os.path.join(src, name), "rb") as fp:
        cur = []
        for line in fp.read().split(b"\n"):
            if line.rstrip(b"\r") == b"%":
                if any(l.strip() for l in cur):
                    fortunes.append(b"\n".join(cur) + b"\n")
                cur = []
            else:
                cur.append(line)
        if any(l.strip() for l in cur):
            fortunes.append(b"\n".join(cur).rstrip(b"\n") + b"\n")
random.Random(20240601).shuffle(fortunes)
text = b"%\n".join(fortunes)
with open(dst, "wb") as fp:
    fp.write(text)
n = len(text)
n_train = n - int(n * 0.1)
counts = [0] * 256
for b in text[:n_train]:
    counts[b] += 1
held = [0] * 256
for b in text[n_train:]:
    held[b] += 1
# held-out cross-entropy of the training text's byte frequencies (add-one)
total = n_train + 256
unigram = -sum(h * math.log((counts[i] + 1) / total)
               for i, h in enumerate(held)) / (n - n_train)
print(json.dumps({"files": len(names), "fortunes": len(fortunes), "bytes": n,
                  "heldout_bytes": n - n_train,
                  "unigram_ce": round(unigram, 4)}))
EOF
echo "data: $(cat "$OUT/data.json")" >&2

COMMON=(--data "$OUT/fortunes.txt" --steps "$STEPS" --batch "$BATCH" --seq "$SEQ"
        --lr "$LR" --holdout 0.1 --eval-every "$EVAL_EVERY"
        --eval-batches "$EVAL_BATCHES" --threads "$THREADS")

now() { date +%s.%N; }

# one `neuroctl init` + `neuroctl train`: $1 = init seed, $2 = data seed,
# $3 = log; prints the training wall time in seconds
train_c() {
    "$NEUROCTL" init --config "$CONFIG" --out "$OUT/init-$1.safetensors" --seed "$1" --force >&2
    local t0 t1
    rm -f "$3" # --log appends
    t0=$(now)
    "$NEUROCTL" train --model "$OUT/init-$1.safetensors" "${COMMON[@]}" --seed "$2" \
        --log "$3" --checkpoint-dir "$OUT/checkpoints-$1-$2${4:+-$4}" \
        ${4:+--precision "$4"} 2>"$3.stderr"
    t1=$(now)
    awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f\n", b - a }'
}

echo "neuroctl train: $STEPS steps of $BATCH x $SEQ, $THREADS threads" >&2
C_WALL=$(train_c 0 "$SEED" "$OUT/neuroctl.jsonl")
T_WALL=0
rm -f "$OUT/torch.jsonl"
if [ "$TORCH" = 1 ]; then
    echo "torch_train.py: the same run" >&2
    t0=$(now)
    "$PY" "$ROOT/bench/torch_train.py" --model "$OUT/init-0.safetensors" "${COMMON[@]}" \
        --seed "$SEED" --log "$OUT/torch.jsonl" >"$OUT/torch.summary.json" 2>"$OUT/torch.jsonl.stderr"
    t1=$(now)
    T_WALL=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f\n", b - a }')
fi
NOISE_LOGS=()
for ((k = 1; k <= NOISE_SEEDS; k++)); do
    echo "neuroctl train: noise run $k of $NOISE_SEEDS (init seed $k, data seed $((SEED + k)))" >&2
    train_c "$k" $((SEED + k)) "$OUT/noise-$k.jsonl" >/dev/null
    NOISE_LOGS+=("$OUT/noise-$k.jsonl")
done
BF16_LOG=
if [ "$BF16" = 1 ]; then
    echo "neuroctl train: the main run again with --precision bf16" >&2
    BF16_WALL=$(train_c 0 "$SEED" "$OUT/bf16.jsonl" bf16)
    BF16_LOG="$OUT/bf16.jsonl:$BF16_WALL"
fi

WIRE_LOGS=
if [ "$WIRE" = 1 ]; then
    # the main run on two stages, as a client of a local cluster
    WIRE_COMMON=(--data "$OUT/fortunes.txt" --steps "$STEPS" --batch "$BATCH" --seq "$SEQ"
                 --lr "$LR" --holdout 0.1 --eval-every "$EVAL_EVERY" --eval-batches "$EVAL_BATCHES")
    for wire in fp32 bf16; do
        echo "neuroctl train --cluster: the main run on 2 nodes with --wire $wire" >&2
        dir="$OUT/cluster-$wire"
        "$NEUROCTL" cluster down --dir "$dir" >/dev/null 2>&1 || true
        "$NEUROCTL" cluster up --dir "$dir" --nodes 2 --threads $((THREADS > 1 ? THREADS / 2 : 1)) \
            --model "$OUT/init-0.safetensors" --wire "$wire" --timeout 300 >&2
        rm -rf "$OUT/checkpoints-wire-$wire" "$OUT/wire-$wire.jsonl"
        t0=$(now)
        "$NEUROCTL" train --cluster "$dir" "${WIRE_COMMON[@]}" --seed "$SEED" \
            --log "$OUT/wire-$wire.jsonl" --checkpoint-dir "$OUT/checkpoints-wire-$wire" \
            2>"$OUT/wire-$wire.jsonl.stderr"
        t1=$(now)
        "$NEUROCTL" cluster down --dir "$dir" >/dev/null
        WIRE_LOGS="$WIRE_LOGS${WIRE_LOGS:+,}$wire:$OUT/wire-$wire.jsonl:$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')"
    done
fi

WIRE_LOGS="$WIRE_LOGS" BF16_LOG="$BF16_LOG" "$PY" - "$OUT" "$C_WALL" "$T_WALL" "$CONFIG" "$STEPS" "$BATCH" "$SEQ" "$LR" "$THREADS" \
    "${NOISE_LOGS[@]}" <<'EOF'
import json, math, os, statistics, sys
out, c_wall, t_wall, config, steps, batch, seq, lr, threads = sys.argv[1:10]
noise_logs = sys.argv[10:]

def read(path):
    with open(path) as fp:
        return [json.loads(line) for line in fp if line.strip()]

def side(rows, wall):
    step_s = sum(int(batch) * int(seq) / r["tokens_per_s"] for r in rows)
    evals = [r for r in rows if "eval_loss" in r]
    return {"final_eval_loss": evals[-1]["eval_loss"],
            "evals": {r["step"]: round(r["eval_loss"], 5) for r in evals},
            "final_train_loss": round(rows[-1]["loss"], 5),
            "wall_s": round(float(wall), 2),
            "tokens_per_s": round(len(rows) * int(batch) * int(seq) / step_s, 1)}

c = read(os.path.join(out, "neuroctl.jsonl"))
tp = os.path.join(out, "torch.jsonl")
t = read(tp) if os.path.exists(tp) else None
if len(c) != int(steps) or (t is not None and len(c) != len(t)):
    sys.exit("logs have %d and %s steps, want %s" % (len(c), len(t) if t else "no", steps))
res = {"bench": "training_quality", "config": os.path.basename(config),
       "steps": int(steps), "batch": int(batch), "seq": int(seq), "lr": float(lr),
       "threads": int(threads), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
       "data": json.load(open(os.path.join(out, "data.json"))),
       "neuroctl": side(c, c_wall)}
diff = 0.0
if t is not None:
    rel = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(c, t)]
    res["torch"] = side(t, t_wall)
    diff = res["neuroctl"]["final_eval_loss"] - res["torch"]["final_eval_loss"]
    res["eval_loss_diff"] = float("%.3g" % diff)
    res["train_loss_rel_diff"] = {"first_10_steps_max": float("%.2g" % max(rel[:10])),
                                  "all_steps_max": float("%.2g" % max(rel)),
                                  "last_step": float("%.2g" % rel[-1])}
if noise_logs:
    finals = [res["neuroctl"]["final_eval_loss"]] + [
        [r for r in read(p) if "eval_loss" in r][-1]["eval_loss"]
        for p in noise_logs]
    sd = statistics.stdev(finals)
    res["noise"] = {"neuroctl_final_eval_losses_by_seed": [round(x, 5) for x in finals],
                    "stdev": round(sd, 5)}
    if t is not None:
        res["within_noise"] = abs(diff) <= 2 * sd
bf16 = os.environ.get("BF16_LOG", "")
if bf16:
    path, wall = bf16.rsplit(":", 1)
    b = side(read(path), wall)
    b["final_eval_loss"] = round(b["final_eval_loss"], 6)
    bdiff = b["final_eval_loss"] - res["neuroctl"]["final_eval_loss"]
    res["bf16"] = b
    res["bf16_minus_fp32_eval_loss"] = float("%.3g" % bdiff)
    if noise_logs:
        res["bf16_within_noise"] = abs(bdiff) <= 2 * sd
wire = os.environ.get("WIRE_LOGS", "")
if wire:
    sides = {}
    for item in wire.split(","):
        name, path, wall = item.split(":")
        sides[name] = side(read(path), wall)
        sides[name]["final_eval_loss"] = round(sides[name]["final_eval_loss"], 6)
    res["wire"] = sides
    wdiff = sides["bf16"]["final_eval_loss"] - sides["fp32"]["final_eval_loss"]
    res["wire_bf16_minus_fp32_eval_loss"] = float("%.3g" % wdiff)
    res["wire_fp32_minus_one_process_eval_loss"] = float(
        "%.3g" % (sides["fp32"]["final_eval_loss"] - res["neuroctl"]["final_eval_loss"]))
    if noise_logs:
        res["wire_bf16_within_noise"] = abs(wdiff) <= 2 * sd
for k in ("neuroctl", "torch"):
    if k in res:
        res[k]["final_eval_loss"] = round(res[k]["final_eval_loss"], 6)
print(json.dumps(res))
EOF
