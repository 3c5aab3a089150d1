#!/usr/bin/env bash
# Issue 18's fine-tuning demo on data Debian ships (the fortune package):
# classify a fortune's file of origin (computers, love, science, politics).
# The base is pretrained by the demo, without labels, as a causal LM on the
# other 39 fortunes files (the four classified files, and so the held-out
# fortunes, stay out of pretraining and of the tokenizer): a BPE tokenizer
# of 2048 ids is learned from that text, then a small model (d 64, L 2) is
# trained for 1600 steps of next-token prediction. It is then fine-tuned
# for classification twice, with the same seed-fixed split (20% held out):
# fully, and with LoRA adapters (rank 8, on every attention map and expert
# matrix) on the frozen base, whose classifier head trains with the
# adapters. Prints held-out accuracy against the majority class, and each
# run's peak RSS and times (and the pretraining's memory model).
# About 2 to 7 minutes on a shared 2-core machine (measured: docs/BENCHMARKS.md).
#   bench/fortunes_demo.sh [BUILD_DIR] [WORK_DIR]
# Why these choices (docs/BENCHMARKS.md, fortunes, has each measurement):
# 2048 BPE ids make most words one id, so mean-pooled states start out as a
# bag of words; a base pretrained with MLM on the four files' own text for
# 400 steps left LoRA at the majority class. Next-token prediction gives a
# gradient at every position (MLM: 15% of them), 4x more text and 4x more
# steps give the base features LoRA can use, and 600 fine-tuning steps
# (lr 5e-3) let the adapters reach full fine-tuning's accuracy.
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
# The pretraining text: every other fortunes file (no .dat/.pdat/.u8, no links).
for f in "$F"/*; do
    case "${f##*/}" in *.dat | *.pdat | *.u8 | computers | love | science | politics) continue ;; esac
    [ -f "$f" ] && [ ! -L "$f" ] || continue
    awk 'BEGIN { RS = "\n%\n" } { gsub(/[\t\n]+/, " "); if (length($0) > 0) print }' "$f"
done > "$W/other.txt"
"$N" tokenizer train --input "$W/other.txt" --vocab-size 2048 --out "$W/tok" --quiet --force
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
causal: true
ffn_act: geglu
objective: clm
num_classes: 4
YAML
T=(/usr/bin/time -f "peak RSS %M KiB, wall %e s, cpu %U s")
"$N" init --config "$W/enc.yaml" --out "$W/init.safetensors" --seed 1 --tokenizer "$W/tok" --force
echo "== pretraining (causal LM) on the other 39 fortunes files' text"
"${T[@]}" "$N" train --model "$W/init.safetensors" --data "$W/other.txt" --steps 1600 --batch 16 \
    --seq 64 --lr 5e-3 --eval-every 1600 --out "$W/base.safetensors" --threads 2 --force 2>&1 |
    grep -E '^training|eval|^wrote|peak RSS'
common=(--objective classify --model "$W/base.safetensors" --data "$W/fortunes.tsv" --steps 600
        --batch 16 --seq 64 --holdout 0.2 --seed 7 --eval-every 600 --threads 2
        --force)
echo "== full fine-tuning"
"${T[@]}" "$N" train "${common[@]}" --lr 2e-3 --out "$W/full.safetensors" 2>&1 |
    grep -E 'memory model|held-out|peak RSS'
echo "== LoRA rank 8 on wq,wk,wv,wo,w_gate,w_up,w_down and the head (base frozen)"
"${T[@]}" "$N" finetune "${common[@]}" --lr 5e-3 --lora-rank 8 --lora-alpha 16 \
    --lora-targets wq,wk,wv,wo,w_gate,w_up,w_down --out "$W/lora.safetensors" 2>&1 |
    grep -E 'memory model|adapter parameters|held-out|peak RSS'
