#!/usr/bin/env bash
# Integration test of the model variants of DESIGN section 6 through
# neuroctl: an encoder (bidirectional, GeGLU, dense FFN, alternating local
# windows, YaRN) initialised from YAML, trained with the masked-LM
# objective until its held-out loss falls, its forward pass, embeddings
# of it (against nlref), a classifier learning a 2-class task, and clear
# refusals: generation from an encoder, mlm on a vocabulary without the
# mask id, an unknown objective or key value.
set -uo pipefail
NEUROCTL="$NL_BUILD_DIR/cli/neuroctl"
DEV=(--device "${NL_TEST_DEVICE:-cpu}")
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }
check() { if "$@"; then ok; else bad "$*"; fi; }

cat > "$W/enc.yaml" <<'YAML'
vocab_size: 300
vocab_chunk: 64
hidden_dim: 32
num_layers: 2
num_heads: 4
num_kv_heads: 2
ffn_dim: 64
num_experts: 1
top_k: 1
max_seq_len: 64
causal: false
ffn_act: geglu
attention_window: 8
global_every: 2
objective: mlm
mask_prob: 0.3
rope_scaling:
  type: yarn
  factor: 2
  original_max_seq_len: 16
YAML
# text with structure the masked model can learn
for i in $(seq 1 400); do echo "the cat sat on the mat and the dog sat on the log $i"; done > "$W/data.txt"

check "$NEUROCTL" init --config "$W/enc.yaml" --out "$W/enc.safetensors" --seed 3
out=$("$NEUROCTL" train "${DEV[@]}" --model "$W/enc.safetensors" --data "$W/data.txt" --steps 60 \
    --batch 8 --seq 32 --lr 3e-3 --warmup 5 --eval-every 10 --log "$W/log.jsonl" \
    --out "$W/enc2.safetensors" --threads 2 2>&1) || bad "mlm train: $out"
first=$(grep -o '"eval_loss":[0-9.]*' "$W/log.jsonl" | head -1 | cut -d: -f2)
last=$(grep -o '"eval_loss":[0-9.]*' "$W/log.jsonl" | tail -1 | cut -d: -f2)
check awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.5) }'
echo "mlm held-out loss: $first -> $last"

# forward of the encoder: logits over 300 ids
python3 - "$W/toks.safetensors" <<'PY'
import json, struct, sys
n = 12
hdr = json.dumps({"tokens": {"dtype": "I32", "shape": [1, n], "data_offsets": [0, 4 * n]}}).encode()
hdr += b" " * (-len(hdr) % 8)
open(sys.argv[1], "wb").write(struct.pack("<Q", len(hdr)) + hdr + struct.pack("<%di" % n, *range(100, 100 + n)))
PY
check "$NEUROCTL" forward "${DEV[@]}" --model "$W/enc2.safetensors" --tokens "$W/toks.safetensors" \
    --out "$W/logits.safetensors"

# embeddings (DESIGN 7): unit rows, independent of the batch they ran in,
# equal to nlref's pooling
printf 'hello world\nthe cat sat on the mat, a much longer line than the others\nshort\n' \
    > "$W/lines.txt"
check "$NEUROCTL" embed "${DEV[@]}" --model "$W/enc2.safetensors" --input "$W/lines.txt" \
    --out "$W/e1.safetensors" --batch 1 --seq 32
check "$NEUROCTL" embed "${DEV[@]}" --model "$W/enc2.safetensors" --input "$W/lines.txt" \
    --out "$W/e3.safetensors" --batch 3 --seq 32
check cmp -s "$W/e1.safetensors" "$W/e3.safetensors"
# and where a batch of one line is fewer positions than the backends'
# decode kernels take (8 < 16): padded, so the same bits as among three
check "$NEUROCTL" embed "${DEV[@]}" --model "$W/enc2.safetensors" --input "$W/lines.txt" \
    --out "$W/e1s.safetensors" --batch 1 --seq 8
check "$NEUROCTL" embed "${DEV[@]}" --model "$W/enc2.safetensors" --input "$W/lines.txt" \
    --out "$W/e3s.safetensors" --batch 3 --seq 8
check cmp -s "$W/e1s.safetensors" "$W/e3s.safetensors"
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
    check /usr/bin/python3 "$NL_SOURCE_DIR/tests/golden/check_embed.py" "$W/enc2.safetensors" \
        "$W/e3.safetensors" "$W/lines.txt" 32
else
    echo "check_embed.py skipped: no python3-torch"
fi

# LoRA: finetune writes adapters and leaves the base byte for byte;
# forward with --adapter equals the merged checkpoint's forward (1e-5);
# generate and embed take the adapter too; a classifier fine-tunes with it
cat > "$W/dec.yaml" <<'YAML'
hidden_dim: 32
num_layers: 2
num_heads: 2
num_kv_heads: 1
ffn_dim: 48
num_experts: 4
vocab_size: 256
vocab_chunk: 128
max_seq_len: 64
YAML
check "$NEUROCTL" init --config "$W/dec.yaml" --out "$W/dec.safetensors" --seed 2
cp "$W/dec.safetensors" "$W/dec.orig"
out=$("$NEUROCTL" finetune "${DEV[@]}" --model "$W/dec.safetensors" --data "$W/data.txt" \
    --steps 20 --batch 4 --seq 32 --lr 1e-2 --lora-rank 4 --lora-alpha 8 \
    --out "$W/ad.safetensors" --threads 2 2>&1) || bad "finetune: $out"
check grep -q "adapter parameters train, the base is frozen" <<< "$out"
check cmp -s "$W/dec.safetensors" "$W/dec.orig"
check "$NEUROCTL" lora merge --model "$W/dec.safetensors" --adapter "$W/ad.safetensors" \
    --out "$W/merged.safetensors"
for f in adapted merged base; do
    case $f in
        adapted) args=(--model "$W/dec.safetensors" --adapter "$W/ad.safetensors") ;;
        merged) args=(--model "$W/merged.safetensors") ;;
        base) args=(--model "$W/dec.safetensors") ;;
    esac
    check "$NEUROCTL" forward "${DEV[@]}" "${args[@]}" --tokens "$W/toks.safetensors" \
        --out "$W/f_$f.safetensors"
done
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
    check /usr/bin/python3 - "$NL_SOURCE_DIR/tests/golden" "$W" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import nlref
lg = {f: nlref.load_safetensors("%s/f_%s.safetensors" % (sys.argv[2], f))[0]["logits"].double()
      for f in ("adapted", "merged", "base")}
rel = lambda a, b: ((a - b).norm() / b.norm()).item()
print("merged vs base + adapter %.3g, base vs adapted %.3g" %
      (rel(lg["merged"], lg["adapted"]), rel(lg["base"], lg["adapted"])))
sys.exit(0 if rel(lg["merged"], lg["adapted"]) < 1e-5 and rel(lg["base"], lg["adapted"]) > 1e-3 else 1)
PY
fi
out=$("$NEUROCTL" generate "${DEV[@]}" --model "$W/dec.safetensors" --adapter "$W/ad.safetensors" \
    --prompt-tokens 1,2,3 --max-new 4 --temperature 0 2>&1) || bad "generate --adapter: $out"
check "$NEUROCTL" embed "${DEV[@]}" --model "$W/dec.safetensors" --adapter "$W/ad.safetensors" \
    --input "$W/lines.txt" --out "$W/e_ad.safetensors" --seq 32
# an adapter applied to another checkpoint (the merged one: other bytes)
# is refused, naming both hashes, and writes nothing
out=$("$NEUROCTL" generate "${DEV[@]}" --model "$W/merged.safetensors" --adapter \
    "$W/ad.safetensors" --prompt-tokens 1,2,3 --max-new 2 --temperature 0 2>&1)
check test $? -ne 0
check grep -q "ad.safetensors: an adapter of the checkpoint with SHA-256 [0-9a-f]\{12\}\.\.\., not of .*merged.safetensors" <<< "$out"
out=$("$NEUROCTL" forward "${DEV[@]}" --model "$W/merged.safetensors" --adapter "$W/ad.safetensors" \
    --tokens "$W/toks.safetensors" --out "$W/f_wrong.safetensors" 2>&1)
check test $? -ne 0
check grep -q "not of .*merged.safetensors" <<< "$out"
check test ! -e "$W/f_wrong.safetensors"
out=$("$NEUROCTL" lora merge --model "$W/merged.safetensors" --adapter "$W/ad.safetensors" \
    --out "$W/merged2.safetensors" 2>&1)
check test $? -ne 0
check grep -q "not of .*merged.safetensors" <<< "$out"
check test ! -e "$W/merged2.safetensors"
# a cluster's --http-adapter too: checked against --model at start (the
# base hashed once for all of them), the coordinator exits naming the one
# of another checkpoint and both hashes
check "$NEUROCTL" finetune "${DEV[@]}" --model "$W/merged.safetensors" --data "$W/data.txt" \
    --steps 1 --batch 2 --seq 16 --lora-rank 2 --out "$W/ad_ok.safetensors" --threads 2
out=$(timeout 60 "$NL_BUILD_DIR/coordinator/neurocoord" --listen 'tcp://127.0.0.1:*' \
    --state-dir "$W/cs" --plaintext --model "$W/merged.safetensors" --http 127.0.0.1:0 \
    --http-adapter "ok=$W/ad_ok.safetensors,tuned=$W/ad.safetensors" 2>&1)
check test $? -eq 1
check grep -q -- "--http-adapter: .*/ad.safetensors: an adapter of the checkpoint with SHA-256 [0-9a-f]\{12\}\.\.\., not of .*merged.safetensors" <<< "$out"
out=$("$NEUROCTL" finetune --model "$W/dec.safetensors" --data "$W/data.txt" --steps 1 \
    --lora-targets wq,w_in --out "$W/x.safetensors" 2>&1)
check test $? -eq 2
check grep -q "'w_in' is not one of wq, wk, wv, wo, w_gate, w_up, w_down" <<< "$out"
# adapters on every expert's w_gate, w_up, w_down (4 experts): trained,
# named per expert, the base unchanged byte for byte
cp "$W/dec.orig" "$W/dec_e.safetensors"
out=$("$NEUROCTL" finetune "${DEV[@]}" --model "$W/dec_e.safetensors" --data "$W/data.txt" \
    --steps 3 --batch 4 --seq 32 --lr 1e-2 --lora-rank 2 --lora-targets wo,w_gate,w_up,w_down \
    --out "$W/ad_e.safetensors" --threads 2 2>&1) || bad "expert finetune: $out"
check cmp -s "$W/dec_e.safetensors" "$W/dec.orig"
check grep -q "layers.1.moe.experts.3.w_down.lora_B.weight" "$W/ad_e.safetensors"
check "$NEUROCTL" lora merge --model "$W/dec_e.safetensors" --adapter "$W/ad_e.safetensors" \
    --out "$W/merged_e.safetensors"

# refusals that name what is wrong
out=$("$NEUROCTL" generate --model "$W/enc2.safetensors" --prompt-tokens 1,2 --max-new 2 2>&1)
check test $? -ne 0
check grep -q "encoder (causal: false) has no kv cache" <<< "$out"
sed -e 's/vocab_size: 300/vocab_size: 256/' -e '/objective/d' "$W/enc.yaml" > "$W/bytes.yaml"
check "$NEUROCTL" init --config "$W/bytes.yaml" --out "$W/bytes.safetensors"
out=$("$NEUROCTL" train --model "$W/bytes.safetensors" --data "$W/data.txt" --steps 1 --batch 2 \
    --seq 8 --objective mlm 2>&1)
check test $? -ne 0
check grep -q "does not hold the mask id 258" <<< "$out"
out=$("$NEUROCTL" train --model "$W/bytes.safetensors" --data "$W/data.txt" --steps 1 --batch 2 \
    --seq 8 --objective next 2>&1)
check test $? -ne 0
check grep -q "'next' is not clm, mlm or classify" <<< "$out"
sed -e 's/ffn_act: geglu/ffn_act: relu/' "$W/enc.yaml" > "$W/relu.yaml"
out=$("$NEUROCTL" init --config "$W/relu.yaml" --out "$W/relu.safetensors" 2>&1)
check test $? -ne 0
check grep -q "ffn_act: expected swiglu or geglu" <<< "$out"

# classification: label<TAB>text, a head on mean-pooled states
for i in $(seq 1 200); do
    printf 'yes\tgood fine great nice %d\nno\tbad awful poor sad %d\n' "$i" "$i"
done > "$W/syn.tsv"
cat > "$W/cls.yaml" <<'YAML'
vocab_size: 256
vocab_chunk: 256
hidden_dim: 32
num_layers: 1
num_heads: 2
num_kv_heads: 1
ffn_dim: 64
num_experts: 1
top_k: 1
causal: false
max_seq_len: 32
num_classes: 2
YAML
check "$NEUROCTL" init --config "$W/cls.yaml" --out "$W/cls.safetensors"
out=$("$NEUROCTL" train "${DEV[@]}" --objective classify --model "$W/cls.safetensors" \
    --data "$W/syn.tsv" --steps 40 --batch 16 --seq 24 --lr 3e-3 --warmup 4 --eval-every 20 \
    --threads 2 --out "$W/cls2.safetensors" 2>&1) || bad "classify train: $out"
check grep -q "into 2 classes" <<< "$out"
acc=$(grep -o 'held-out accuracy [0-9.]*' <<< "$out" | tail -1 | cut -d' ' -f3)
check awk -v a="$acc" 'BEGIN { exit !(a > 0.95) }'
echo "classifier held-out accuracy: $acc"
out=$("$NEUROCTL" train --objective classify --model "$W/enc.safetensors" --data "$W/syn.tsv" \
    --steps 1 --batch 2 --seq 8 2>&1)
check test $? -ne 0
check grep -q "has no classifier (set num_classes" <<< "$out"
printf 'yes\tfine\nno label here\n' > "$W/broken.tsv"
out=$("$NEUROCTL" train --objective classify --model "$W/cls.safetensors" --data "$W/broken.tsv" \
    --steps 1 --batch 2 --seq 8 2>&1)
check test $? -ne 0
check grep -q "broken.tsv:2: expected label<TAB>text" <<< "$out"

# the classifier fine-tuned with adapters on two maps
out=$("$NEUROCTL" finetune "${DEV[@]}" --objective classify --model "$W/cls.safetensors" \
    --data "$W/syn.tsv" --steps 40 --batch 16 --seq 24 --lr 1e-2 --warmup 4 --eval-every 40 \
    --lora-rank 4 --lora-targets wq,wv --out "$W/cls_ad.safetensors" --threads 2 2>&1) ||
    bad "classify finetune: $out"
check test -s "$W/cls_ad.safetensors"
# the head trains with the adapters and travels in their file
check grep -q "classifier.weight" "$W/cls_ad.safetensors"

echo "test_families_cli: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
