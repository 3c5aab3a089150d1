#!/usr/bin/env bash
# Issue 18's fine-tuning demo on data Debian ships (the fortune package):
# classify a fortune's file of origin (computers, love, science, politics).
# A small encoder is pretrained by the demo with the masked-LM objective on
# the fortunes' text, then fine-tuned for classification twice, with the
# same seed-fixed split: fully, and with LoRA adapters on the frozen base.
# Prints held-out accuracy against the majority class and each run's peak
# RSS.   bench/fortunes_demo.sh [BUILD_DIR] [WORK_DIR]
set -euo pipefail
B=${1:-build}
W=${2:-$(mktemp -d)}
N="$B/cli/neuroctl"
F=/usr/share/games/fortunes
mkdir -p "$W"
for c in computers love science politics; do
    [ -f "$F/$c" ] || { echo "no $F/$c: apt-get install fortunes" >&2; exit 1; }
    awk -v c=$c 'BEGIN { RS = "\n%\n" } { gsub(/[\t\n]+/, " "); if (length($0) > 0) print c "\t" $0 }' "$F/$c"
done > "$W/fortunes.tsv"
cut -f2 "$W/fortunes.tsv" > "$W/fortunes.txt"
cat > "$W/enc.yaml" <<'YAML'
vocab_size: 300
vocab_chunk: 64
hidden_dim: 64
num_layers: 2
num_heads: 4
num_kv_heads: 2
ffn_dim: 128
num_experts: 1
top_k: 1
max_seq_len: 128
causal: false
ffn_act: geglu
objective: mlm
num_classes: 4
YAML
T=(/usr/bin/time -f "peak RSS %M KiB")
"$N" init --config "$W/enc.yaml" --out "$W/init.safetensors" --seed 1
echo "== pretraining (mlm) on the fortunes' text"
"${T[@]}" "$N" train --model "$W/init.safetensors" --data "$W/fortunes.txt" --steps 300 --batch 16 \
    --seq 64 --lr 2e-3 --eval-every 300 --out "$W/base.safetensors" --threads 2 2>&1 |
    grep -v '^step' | tail -3
common=(--objective classify --model "$W/base.safetensors" --data "$W/fortunes.tsv" --steps 200
        --batch 16 --seq 96 --holdout 0.2 --seed 7 --eval-every 200 --eval-batches 32 --threads 2)
echo "== full fine-tuning"
"${T[@]}" "$N" train "${common[@]}" --lr 1e-3 --out "$W/full.safetensors" 2>&1 | grep -v '^step' | tail -3
echo "== LoRA rank 8 on wq,wk,wv,wo (base frozen)"
"${T[@]}" "$N" finetune "${common[@]}" --lr 3e-3 --lora-rank 8 --lora-alpha 16 \
    --out "$W/lora.safetensors" 2>&1 | grep -v '^step' | tail -4
