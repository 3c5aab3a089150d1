#!/usr/bin/env bash
# The main job: train a small model on English text (Debian's fortunes)
# with visible progress, save a checkpoint, bring up a local cluster (a
# coordinator and 3 nodes as separate processes on loopback) serving it,
# generate text through the pipeline, and stop the cluster.
# Everything lands in out/demo/. Safe to run again.
#   scripts/demo.sh [--steps N] [--threads N]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=500
THREADS=$(nproc)
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    *) echo "usage: scripts/demo.sh [--steps N] [--threads N]" >&2; exit 2 ;;
  esac
done

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
$NEUROCTL tokenizer train --input "$DATA" --vocab-size 2048 --out "$OUT/tokenizer.bpe" --quiet
$NEUROCTL init --config configs/tiny.yaml --tokenizer "$OUT/tokenizer.bpe" \
  --out "$OUT/init.safetensors" --seed 1
$NEUROCTL train --model "$OUT/init.safetensors" --data "$DATA" --steps "$STEPS" --batch 16 \
  --seq 128 --lr 2e-3 --warmup 30 --eval-every 100 --log "$OUT/train.jsonl" \
  --out "$OUT/model.safetensors" --threads "$THREADS"

# Serve the checkpoint from a local cluster: 3 nodes, each a pipeline stage.
CLUSTER=$OUT/cluster
$NEUROCTL cluster down --dir "$CLUSTER" >/dev/null 2>&1 || true
trap '$NEUROCTL cluster down --dir "$CLUSTER" >/dev/null 2>&1 || true' EXIT
$NEUROCTL cluster up --dir "$CLUSTER" --nodes 3 --model "$OUT/model.safetensors" --memory 512M
$NEUROCTL status --cluster "$CLUSTER"
for prompt in "The " "Q: What is " "A man "; do
  printf '\n--- '
  $NEUROCTL generate --cluster "$CLUSTER" --prompt "$prompt" --max-new 60 \
    --temperature 0.7 --top-p 0.9 --seed 3
done
$NEUROCTL cluster down --dir "$CLUSTER"
