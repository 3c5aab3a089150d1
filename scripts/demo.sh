#!/usr/bin/env bash
# The main job: bring up a local cluster (a coordinator and 3 nodes as
# separate processes on loopback), train a small model across its 3
# pipeline stages on English text (Debian's fortunes) with visible
# progress, save a sharded checkpoint and join it into one file, generate
# text through the pipeline, and stop the cluster. The coordinator serves
# the dashboard and the HTTP API while it trains (its address is printed);
# with --serve the cluster stays up after training, serving the trained
# model over HTTP, until Ctrl-C.
# Everything lands in out/demo/. Safe to run again.
#   scripts/demo.sh [--steps N] [--threads N] [--serve] [--http HOST:PORT]
#     --threads: per node, default 1; --http: default 127.0.0.1:8080
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=500
THREADS=1
SERVE=0
HTTP=127.0.0.1:8080
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --serve) SERVE=1; shift ;;
    --http) HTTP=$2; shift 2 ;;
    *) echo "usage: scripts/demo.sh [--steps N] [--threads N] [--serve] [--http HOST:PORT]" >&2; exit 2 ;;
  esac
done
# the default port taken by something else: any free one (the address is printed)
if [ "$HTTP" = 127.0.0.1:8080 ] && (exec 3<>/dev/tcp/127.0.0.1/8080) 2>/dev/null; then
  echo "demo: 127.0.0.1:8080 is taken; the dashboard goes on a free port" >&2
  HTTP=127.0.0.1:0
fi

bash scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc)" --target neuroctl neurocoord neuronode
NEUROCTL=build/cli/neuroctl
OUT=out/demo
mkdir -p "$OUT"

# English text: every fortune file Debian ships, as plain text.
DATA=$OUT/fortunes.txt
if [ ! -s "$DATA" ]; then
  find /usr/share/games/fortunes -type f ! -name '*.dat' ! -name '*.u8' ! -name '*.pdat' \
    -exec cat {} + | tr -d '\r' > "$DATA"
fi
echo "data: $(wc -c < "$DATA") bytes of fortunes"

# A byte-level BPE tokenizer learned from the text; the checkpoint carries it.
$NEUROCTL tokenizer train --input "$DATA" --vocab-size 2048 --out "$OUT/tokenizer.bpe" --quiet --force
$NEUROCTL init --config configs/tiny.yaml --tokenizer "$OUT/tokenizer.bpe" \
  --out "$OUT/init.safetensors" --seed 1 --force

# A local cluster: a coordinator and 3 nodes, each a pipeline stage with one
# thread (3 nodes share this machine's cores).
CLUSTER=$OUT/cluster
$NEUROCTL cluster down --dir "$CLUSTER" >/dev/null 2>&1 || true
trap '$NEUROCTL cluster down --dir "$CLUSTER" >/dev/null 2>&1 || true' EXIT
$NEUROCTL cluster up --dir "$CLUSTER" --nodes 3 --model "$OUT/init.safetensors" --memory 512M \
  --threads "$THREADS" --http "$HTTP"
$NEUROCTL status --cluster "$CLUSTER"
URL=$(cat "$CLUSTER/coord/http")
echo "dashboard: $URL  (the nodes, the plan, the loss as it trains; API: ${URL}v1/completions)"

# Train across the 3 stages (1F1B over 4 microbatches), with a sharded
# checkpoint every 100 steps; the final shards are joined into one file.
rm -rf "$OUT/checkpoints"
$NEUROCTL train --cluster "$CLUSTER" --data "$DATA" --steps "$STEPS" --batch 16 --seq 128 \
  --microbatches 4 --lr 2e-3 --warmup 30 --eval-every 100 --checkpoint-every 100 \
  --checkpoint-dir "$OUT/checkpoints" --log "$OUT/train.jsonl" --out "$OUT/model.safetensors" --force

# Generate from the trained model the nodes now hold.
for prompt in "The " "Q: What is " "A man "; do
  printf '\n--- '
  $NEUROCTL generate --cluster "$CLUSTER" --prompt "$prompt" --max-new 60 \
    --temperature 0.7 --top-p 0.9 --seed 3
done
if [ "$SERVE" = 1 ]; then
  printf '\n\ndashboard: %s\ntry: curl %sv1/completions -H '"'"'Content-Type: application/json'"'"' -d '"'"'{"prompt": "The ", "max_tokens": 40, "seed": 3}'"'"'\n' \
    "$URL" "$URL"
  echo "serving until Ctrl-C"
  trap 'echo; $NEUROCTL cluster down --dir "$CLUSTER"; exit 0' INT TERM
  while kill -0 "$(cat "$CLUSTER/coord.pid")" 2>/dev/null; do sleep 1; done
  echo "the coordinator stopped; see $CLUSTER/coord.log" >&2
  exit 1
fi
$NEUROCTL cluster down --dir "$CLUSTER"
# What to try next (tests/check_doc_flags.py checks these commands' flags).
cat <<EOF

what next (. scripts/env.sh puts neuroctl on your PATH):
  neuroctl generate --model $OUT/model.safetensors --prompt "Q: Why " --max-new 60 --temperature 0.7
  neuroctl serve --model $OUT/model.safetensors --http 127.0.0.1:8080   # the HTTP API, in one process
  neuroctl train --model $OUT/model.safetensors --data YOUR.txt --steps 200 --out $OUT/yours.safetensors
  scripts/demo.sh --serve   # the same run, then the cluster stays up serving it (dashboard, HTTP API)
(README.md: training on your own text, the cluster across machines, the HTTP API)
EOF
