#!/usr/bin/env bash
# Soak (issue 22): a local cluster trains while random nodes are killed and
# restarted; run by hand, not in CI.
#   bench/soak.sh BUILD_DIR [MINUTES] [MIN_GAP_S] [MAX_GAP_S]
# (defaults: 30 minutes, a kill every 60 to 180 s). 4 nodes train a small
# model with checkpoints every 20 steps and --train-resumes 1000; every
# gap a random node is SIGKILLed and started again 5 s later (same key:
# it joins again). At the end: steps completed, resumes, the time lost per
# event (kill -> first step after the resume, from the logs), and whether
# the last manifest verifies (neuroctl export reads every shard's hash).
# CONFIG=configs/bench-small.yaml trains that config instead of the small
# default one (d=64, L=8).
set -uo pipefail
B=${1:?usage: soak.sh BUILD_DIR [MINUTES] [MIN_GAP_S] [MAX_GAP_S]}
MIN=${2:-30}
GAP0=${3:-60}
GAP1=${4:-180}
N="$B/cli/neuroctl"
W=$(mktemp -d)
job=0
C="$W/c"
trap '"$N" cluster down --dir "$C" >/dev/null 2>&1; kill $job 2>/dev/null; echo "work dir $W"' EXIT
# NL_TEST_GFLOPS is a test hook: BUILD_DIR must be a test build (-DNL_TEST_HOOKS=ON)
grep -aq NL_TEST_GFLOPS "$B/node/neuronode" ||
  { echo "$B is not a test build (-DNL_TEST_HOOKS=ON): its nodes ignore NL_TEST_GFLOPS" >&2; exit 2; }
export NL_TEST_GFLOPS=20
if [ -n "${CONFIG:-}" ]; then
  cp "$CONFIG" "$W/cfg.yaml" || exit 1
else
  cat > "$W/cfg.yaml" <<'YAML'
hidden_dim: 64
num_layers: 8
num_heads: 4
num_kv_heads: 2
ffn_dim: 128
num_experts: 4
vocab_size: 256
vocab_chunk: 256
max_seq_len: 128
YAML
fi
SRC=$(cd "$(dirname "$0")/.." && pwd)
cp "$SRC"/tests/data/corpus.txt "$W/data.txt"
"$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7 >/dev/null || exit 1
"$N" cluster up --dir "$C" --nodes 4 --model "$W/m.safetensors" --memory 256M --threads 1 \
  --node-timeout-ms 2000 --train-resumes 1000 --timeout 120 || exit 1
"$N" train --cluster "$C" --data "$W/data.txt" --steps 100000000 --batch 16 --seq 64 \
  --microbatches 2 --lr 1e-3 --min-lr 1e-3 --warmup 0 --checkpoint-every 20 \
  --checkpoint-dir "$W/ck" --log "$W/train.jsonl" 2> "$W/train.err" &
job=$!
end=$(($(date +%s) + MIN * 60))
kills=0
: > "$W/kills.txt"
while [ "$(date +%s)" -lt "$end" ] && kill -0 $job 2>/dev/null; do
  sleep $((GAP0 + RANDOM % (GAP1 - GAP0 + 1)))
  k=$((1 + RANDOM % 4))
  pid=$(cat "$C/node-$k.pid")
  echo "$(date +%s.%N) node-$k" >> "$W/kills.txt"
  kill -9 "$pid" 2>/dev/null
  kills=$((kills + 1))
  sleep 5
  # start it again as cluster up did (its command line, from /proc is gone:
  # rebuild it)
  "$B/node/neuronode" join "$(cat "$C/coord/endpoint")" --key "$C/node-$k.key" \
    --coordinator-key "$C/coord/coordinator.pub" --threads 1 --name "node-$k" --device cpu \
    --memory 256M --checkpoint-root / >> "$C/node-$k.log" 2>&1 &
  echo $! > "$C/node-$k.pid"
done
kill -INT $job 2>/dev/null
wait $job 2>/dev/null
steps=$(grep -c '"step":' "$W/train.jsonl")
last=$(grep -o '"step":[0-9]*' "$W/train.jsonl" | tail -1 | cut -d: -f2)
resumes=$(grep -c '"event":"node_lost"' "$W/train.jsonl")
echo "minutes: $MIN; kills: $kills; resumes: $resumes; step records: $steps; last step: $last"
echo "time from the death being declared to the first step after the resume (s):"
grep -o "the first after the resume, done [0-9.]* s" "$C/coord.log" | awk '{ print $7 }' | tr '\n' ' '
echo
echo "time from the kill to that step (s; heartbeat timeout 2 s included):"
python3 - "$W/kills.txt" "$C/coord.log" <<'PY'
import re, sys, time, datetime
kills = [float(l.split()[0]) for l in open(sys.argv[1])]
# coord.log times are wall-clock HH:MM:SS.mmm of today
out = []
for l in open(sys.argv[2]):
    m = re.match(r"(\d\d):(\d\d):(\d\d\.\d+) .*the first after the resume", l)
    if m:
        d = datetime.datetime.now().replace(hour=int(m[1]), minute=int(m[2]), second=0, microsecond=0)
        out.append(d.timestamp() + float(m[3]))
# a kill is paired with the first resumed step before the next kill; none:
# the node killed was a standby (no stage lost), shown as "-"
for i, k in enumerate(kills):
    nxt = kills[i + 1] if i + 1 < len(kills) else float("inf")
    after = [t for t in out if k < t < nxt]
    print("%.2f" % (after[0] - k) if after else "-", end=" ")
print()
PY
# the newest checkpoint with a manifest (the job is stopped by SIGINT at the
# end: a checkpoint it was writing then has shards but no manifest)
man=$(ls -d "$W"/ck/step-*/manifest.json 2>/dev/null | tail -1)
man=${man%/manifest.json}
if [ -n "$man" ] && "$N" export --manifest "$man" --out "$W/final.safetensors" >/dev/null 2>&1; then
  echo "the last manifest ($man) verifies"
else
  echo "the last manifest ($man) does NOT verify"
fi
