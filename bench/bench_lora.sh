#!/usr/bin/env bash
# Issues 18 and 32: LoRA fine-tuning against full fine-tuning on the same
# base (configs/bench-small.yaml by default), in one process and on a
# 3-node local cluster:
#   step     median seconds per step over steps 2..STEPS, from the runs' own
#            logs (tokens_per_s of each step: batch x seq / step time)
#   cpu      local runs: CPU seconds (user + sys) per step, (CPU of the
#            STEPS-step run - CPU of a 1-step twin) / (STEPS - 1): what
#            the process computed, which a loaded machine's other work
#            does not add to as it does to wall time
#   peak     peak RSS: the one process (/usr/bin/time), and each node's
#            VmHWM (read from /proc before the cluster goes down); each run
#            on a fresh process or cluster, so no peak hides another
#   model    the memory model of the training run (neuroctl train's line),
#            and LoRA's (the same without the base's AdamW moments; the
#            adapters' own are counted)
#   ratio    LoRA's steps/s over full fine-tuning's (full s/step over LoRA's),
#            by wall time and by CPU time: each local pair's, and the
#            cluster's by wall time (issue 32's target: at least 1.5)
# Local runs are interleaved with their LoRA twins (full, LoRA, full, ...)
# REPS times, so a loaded machine disturbs both alike; report ratios.
#   bench/bench_lora.sh [BUILD_DIR]
#   env: CONFIG (configs/bench-small.yaml), STEPS (6), BATCH (8), SEQ (256),
#        MICRO (4), RANK (8), THREADS (1: the process's; each node gets 1:
#        on a machine other jobs load, OpenMP with more threads than free
#        cores spins at its barriers and the step times mean nothing),
#        REPS (2), CLUSTER (1; 0: the local runs only)
set -euo pipefail
B=${1:-build}
CONFIG=${CONFIG:-configs/bench-small.yaml}
STEPS=${STEPS:-6}
BATCH=${BATCH:-8}
SEQ=${SEQ:-256}
MICRO=${MICRO:-4}
RANK=${RANK:-8}
THREADS=${THREADS:-1}
REPS=${REPS:-2}
CLUSTER=${CLUSTER:-1}
N=$B/cli/neuroctl
W=$(mktemp -d)
trap 'for c in "$W"/c-*; do "$N" cluster down --dir "$c" >/dev/null 2>&1 || true; done; rm -rf "$W"' EXIT
"$N" init --config "$CONFIG" --out "$W/m.safetensors" --seed 1 >/dev/null
cp tests/data/corpus.txt "$W/data.txt"
RUN=(--data "$W/data.txt" --batch "$BATCH" --seq "$SEQ" --microbatches "$MICRO"
     --lr 1e-3 --seed 1 --force)
LORA=(--lora-rank "$RANK" --lora-alpha 16 --lora-targets "wq,wk,wv,wo")

# median seconds per step of a log, steps 2.. (step 1 warms up)
step_s() {
    /usr/bin/python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ts = [float(sys.argv[2]) / r["tokens_per_s"] for r in rows if "step" in r and r["step"] > 1]
print("%.3f" % statistics.median(ts))' "$1" $((BATCH * SEQ))
}
rss_mb() { sed -n 's/.*Maximum resident set size (kbytes): \([0-9]*\).*/\1/p' "$1" | awk '{printf "%.1f", $1 / 1024}'; }
cpu_s() { awk -F': ' '/User time|System time/ { s += $2 } END { printf "%.3f", s }' "$1"; }

local_run() { # what (train|finetune) rep
    local what=$1 i=$2 extra=() one
    [ "$what" = finetune ] && extra=("${LORA[@]}")
    for one in 1 0; do # the 1-step twin, then the run
        /usr/bin/time -v "$N" "$what" --model "$W/m.safetensors" "${RUN[@]}" "${extra[@]}" \
            --steps "$([ $one = 1 ] && echo 1 || echo "$STEPS")" --threads "$THREADS" \
            --log "$W/l-$what-$i.jsonl" --out "$W/l-$what-$i.safetensors" \
            --checkpoint-dir "$W/ck-l" 2>"$W/l-$what-$i-$one.err"
    done
    step_s "$W/l-$what-$i.jsonl" >"$W/l-$what-$i.s"
    echo "$(cpu_s "$W/l-$what-$i-0.err") $(cpu_s "$W/l-$what-$i-1.err")" |
        awk -v n="$STEPS" '{ printf "%.3f", ($1 - $2) / (n - 1) }' >"$W/l-$what-$i.cpu"
    echo "local $what rep $i: $(cat "$W/l-$what-$i.s") s/step, cpu $(cat "$W/l-$what-$i.cpu") s/step," \
        "peak RSS $(rss_mb "$W/l-$what-$i-0.err") MB ($(grep -o 'memory model: [0-9.]* MiB' "$W/l-$what-$i-0.err"))"
}

cluster_run() { # what
    local what=$1 C=$W/c-$1 extra=()
    [ "$what" = finetune ] && extra=("${LORA[@]}")
    "$N" cluster up --dir "$C" --nodes 3 --model "$W/m.safetensors" --memory 4G --threads 1 >/dev/null
    "$N" "$what" --cluster "$C" "${RUN[@]}" "${extra[@]}" --steps "$STEPS" --log "$W/c-$what.jsonl" \
        --out "$W/c-$what.safetensors" --checkpoint-dir "$W/ck-$what" 2>"$W/c-$what.err"
    local peaks=""
    for p in "$C"/node-*.pid; do
        peaks+="$(awk '/VmHWM/ {printf "%.1f ", $2 / 1024}' "/proc/$(cat "$p")/status")"
    done
    step_s "$W/c-$what.jsonl" >"$W/c-$what.s"
    echo "3 nodes $what: $(cat "$W/c-$what.s") s/step, nodes' peak RSS (MB): $peaks"
    "$N" cluster down --dir "$C" >/dev/null 2>&1
}

# LoRA's steps/s over full fine-tuning's, from two s/step files
ratio() { echo "$(cat "$1") $(cat "$2")" | awk '{ printf "%.2f", $1 / $2 }'; }

for ((i = 1; i <= REPS; i++)); do
    local_run train "$i"
    local_run finetune "$i"
    echo "local rep $i: LoRA/full steps/s ratio $(ratio "$W/l-train-$i.s" "$W/l-finetune-$i.s")" \
        "(wall), $(ratio "$W/l-train-$i.cpu" "$W/l-finetune-$i.cpu") (CPU)"
done
if [ "$CLUSTER" != 0 ]; then
    cluster_run train
    cluster_run finetune
    echo "3 nodes: LoRA/full steps/s ratio $(ratio "$W/c-train.s" "$W/c-finetune.s")"
fi
# the memory model, as the stages count it (core/model/memory.h; LoRA: without
# the base's moments, as node/stage_train.c checks a fine-tuning job)
/usr/bin/python3 - "$CONFIG" "$BATCH" "$SEQ" "$MICRO" "$RANK" <<'PY'
import sys
cfg = {}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if ":" in line:
        k, v = line.split(":", 1); cfg[k.strip()] = v.strip()
d, L, H, G = int(cfg["hidden_dim"]), int(cfg["num_layers"]), int(cfg["num_heads"]), int(cfg["num_kv_heads"])
hd = d // H; r = int(sys.argv[5])
# adapters on wq, wk, wv, wo: r x (in + out) each
per_layer = r * (d + H * hd) + r * (d + G * hd) * 2 + r * (H * hd + d)
print("adapters: %d parameters (rank %d on wq, wk, wv, wo of %d layers): %.2f MB with "
      "gradients and moments" % (per_layer * L, r, L, per_layer * L * 16 / 1e6))
PY
