#!/usr/bin/env bash
# Issue 18's fine-tuning demo on data Debian ships (the fortune package):
# classify a fortune's file of origin (computers, love, science, politics).
# A BPE tokenizer (2048 ids) is learned from the fortunes' text and a small
# encoder is pretrained by the demo with the masked-LM objective on that
# text (no labels), then fine-tuned for classification twice, with the same
# seed-fixed split (20% held out): fully, and with LoRA adapters (rank 8,
# on every attention map and expert matrix) on the frozen base, whose
# classifier head trains with the adapters. Prints held-out accuracy against
# the majority class, and each run's memory model, peak RSS and times.
# About 3.5 minutes on a 2-core machine (measured: docs/BENCHMARKS.md).
#   bench/fortunes_demo.sh [BUILD_DIR] [WORK_DIR]
# Why these choices (the first recipe, byte-level ids, stayed at the
# majority class): a fortune's topic is in its words, and 2048 BPE ids make
# most words one id, so the mean-pooled states start out as a bag of words.
# Full fine-tuning then beats the majority class; LoRA on this small,
# briefly pretrained base does not yet (docs/BENCHMARKS.md, fortunes).
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
"$N" tokenizer train --input "$W/fortunes.txt" --vocab-size 2048 --out "$W/tok" --quiet --force
cat > "$W/enc.yaml" <<'YAML'
vocab_size: 2048
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
T=(/usr/bin/time -f "peak RSS %M KiB, wall %e s, cpu %U s")
"$N" init --config "$W/enc.yaml" --out "$W/init.safetensors" --seed 1 --tokenizer "$W/tok" --force
echo "== pretraining (mlm) on the fortunes' text"
"${T[@]}" "$N" train --model "$W/init.safetensors" --data "$W/fortunes.txt" --steps 400 --batch 16 \
    --seq 64 --lr 2e-3 --eval-every 400 --out "$W/base.safetensors" --threads 2 --force 2>&1 |
    grep -v '^step' | grep -v '^tokenized' | tail -4
common=(--objective classify --model "$W/base.safetensors" --data "$W/fortunes.tsv" --steps 300
        --batch 16 --seq 64 --holdout 0.2 --seed 7 --eval-every 300 --eval-batches 32 --threads 2
        --force)
echo "== full fine-tuning"
"${T[@]}" "$N" train "${common[@]}" --lr 2e-3 --out "$W/full.safetensors" 2>&1 |
    grep -E 'memory model|held-out|peak RSS'
echo "== LoRA rank 8 on wq,wk,wv,wo,w_gate,w_up,w_down and the head (base frozen)"
"${T[@]}" "$N" finetune "${common[@]}" --lr 5e-3 --lora-rank 8 --lora-alpha 16 \
    --lora-targets wq,wk,wv,wo,w_gate,w_up,w_down --out "$W/lora.safetensors" 2>&1 |
    grep -E 'memory model|adapter parameters|held-out|peak RSS'
