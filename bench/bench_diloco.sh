#!/usr/bin/env bash
# Issue 30 item 6: DiLoCo (neurocoord --outer-every H) against every-step
# sync of the same replicas, local clusters on one machine, in one run:
# R replica groups of one stage each (R nodes, --replicas R), the same
# batches from the same seed, the same number of tokens; then
#   - replica traffic: the REDUCE frame bytes every node sent in the job
#     (each node logs them when the job ends), in all, and their ratio
#     (the issue's target: at least 10x less with H = 50);
#   - the held-out loss at the last step (--eval-every STEPS) of each, and
#     DiLoCo's relative to every-step sync's (target: within 2%).
#   bench/bench_diloco.sh [BUILD_DIR]
#   env: CONFIG (configs/bench-small.yaml), R (4), H (50: one H, or a list
#        "5 10 20 50", each against the one every-step sync run), STEPS (200),
#        BATCH (8), SEQ (64), MICRO (4), LR (1e-3), EVAL_BATCHES (8),
#        EVAL_EVERY (STEPS; a multiple of every H: each run's held-out
#        losses along the way are printed as "curve"), WARM (0: from the
#        initialised model; N: both runs start from the weights of N steps
#        of training in one process with the same batch, lr and seed 2, as
#        the DiLoCo paper starts from a pretrained model; the tokens
#        compared are then those after the warm start), OUTER_LR (0.7),
#        OUTER_MOM (0.9): DiLoCo's outer step (--outer-lr, --outer-momentum)
# Prints one JSON line per H and the load average at the start and end.
set -euo pipefail
B=${1:-build}
CONFIG=${CONFIG:-configs/bench-small.yaml}
R=${R:-4}
H=${H:-50}
STEPS=${STEPS:-200}
BATCH=${BATCH:-8}
SEQ=${SEQ:-64}
MICRO=${MICRO:-4}
LR=${LR:-1e-3}
EVAL_BATCHES=${EVAL_BATCHES:-8}
EVAL_EVERY=${EVAL_EVERY:-$STEPS}
WARM=${WARM:-0}
OUTER_LR=${OUTER_LR:-0.7}
OUTER_MOM=${OUTER_MOM:-0.9}
N=$B/cli/neuroctl
PY=/usr/bin/python3
W=$(mktemp -d)
down() {
    for d in "$W"/c*; do [ -d "$d" ] && "$N" cluster down --dir "$d" >/dev/null 2>&1; done
    return 0
}
trap 'down; rm -rf "$W"' EXIT
echo "bench_diloco: start, $(uptime)" >&2
"$N" init --config "$CONFIG" --out "$W/m.safetensors" --seed 7 >/dev/null
cp tests/data/corpus.txt "$W/data.txt"
if [ "$WARM" -gt 0 ]; then
    "$N" train --model "$W/m.safetensors" --data "$W/data.txt" --steps "$WARM" --batch "$BATCH" \
        --seq "$SEQ" --microbatches "$MICRO" --lr "$LR" --seed 2 --threads 2 \
        --checkpoint-dir "$W/ck-warm" --out "$W/warm.safetensors" --progress-every 0 >/dev/null 2>&1
    mv "$W/warm.safetensors" "$W/m.safetensors"
fi
RUN=(--data "$W/data.txt" --steps "$STEPS" --batch "$BATCH" --seq "$SEQ" --microbatches "$MICRO"
     --lr "$LR" --seed 1 --eval-every "$EVAL_EVERY" --eval-batches "$EVAL_BATCHES")

# one training run: its log in $W/$1.jsonl, the nodes' logs in $W/c-$1
train() {
    local name=$1 h=$2
    local c="$W/c-$name"
    "$N" cluster up --dir "$c" --nodes "$R" --replicas "$R" --outer-every "$h" \
        --outer-lr "$OUTER_LR" --outer-momentum "$OUTER_MOM" \
        --model "$W/m.safetensors" --memory 2G --threads 1 --timeout 120 --rebalance-after 0 \
        --node-timeout-ms 30000 >/dev/null
    "$N" train --cluster "$c" "${RUN[@]}" --checkpoint-dir "$W/ck-$name" --log "$W/$name.jsonl" \
        2>/dev/null
    "$N" cluster down --dir "$c" >/dev/null
}
train sync 0
for h in $H; do
    [ "$STEPS" -gt 0 ] && [ $((STEPS % h)) -eq 0 ] || { echo "bench_diloco: STEPS $STEPS is not a multiple of H $h" >&2; exit 2; }
    train "diloco$h" "$h"
    $PY - "$W" "$R" "$h" "$STEPS" "$BATCH" "$SEQ" "$WARM" "$OUTER_LR" "$OUTER_MOM" <<'PY'
import glob, json, re, sys
w, R, H, steps, batch, seq = sys.argv[1], *map(int, sys.argv[2:7])
def run(name):
    rows = [json.loads(l) for l in open("%s/%s.jsonl" % (w, name))]
    ev = [r["eval_loss"] for r in rows if "eval_loss" in r]
    sent = [int(x) for f in glob.glob("%s/c-%s/node-*.log" % (w, name))
            for x in re.findall(r"sent (\d+) bytes of REDUCE frames to the next", open(f).read())]
    assert ev and len(sent) == R, (name, ev, sent)
    return ev, sum(sent)
(cs, bs), (cd, bd) = run("sync"), run("diloco%d" % H)
es, ed = cs[-1], cd[-1]
print(json.dumps({"bench": "diloco", "replicas": R, "warm": int(sys.argv[7]),
                  "outer_lr": float(sys.argv[8]), "outer_momentum": float(sys.argv[9]),
                  "outer_every": H, "steps": steps,
                  "tokens": steps * batch * seq,
                  "sync": {"reduce_bytes": bs, "eval_loss": round(es, 5)},
                  "diloco": {"reduce_bytes": bd, "eval_loss": round(ed, 5)},
                  "traffic_ratio": round(bs / bd, 2) if bd else None,
                  "eval_loss_rel": round(ed / es - 1, 5),
                  "curve": {"sync": [round(x, 4) for x in cs],
                            "diloco": [round(x, 4) for x in cd]}}), flush=True)
PY
done
echo "bench_diloco: end, $(uptime)" >&2
