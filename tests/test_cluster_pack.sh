#!/usr/bin/env bash
# Packed rows (--pack, DESIGN 6) on a cluster, as real processes on
# loopback, each against neuroctl in one process on the same checkpoint,
# seed, data and batches (a .tok stream of documents each ended by
# <|end|>, id 257):
#  - clm on a decoder with 4 experts (top 2) over 3 nodes, 2 microbatches
#    (the counting pass's hops carry the documents too): every step's loss
#    and eval loss, and the final weights and moments, bit for bit;
#  - LoRA fine-tuning of the same decoder with --pack, adapters on wq, wv
#    and every expert's w_gate and w_down: losses and the adapter file bit
#    for bit;
#  - mlm on an encoder (causal: false, geglu, alternating windows) over 2
#    nodes, with --recompute (a backward recomputes its forward with the
#    documents it kept): losses and weights bit for bit;
#  - packing changes the run (the same run without --pack has other
#    losses), and the refusals: --pack with classify (local and cluster),
#    --pack on a vocabulary without <|end|> (local).
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20 # equal throughputs: N nodes make N stages

small_config "$W/dec.yaml" 32 3 48 32
sed -i 's/^vocab_size: 256/vocab_size: 264/; s/^vocab_chunk: 256/vocab_chunk: 264/' "$W/dec.yaml"
echo "num_classes: 3" >> "$W/dec.yaml"
cat > "$W/enc.yaml" <<'YAML'
hidden_dim: 32
num_layers: 2
num_heads: 4
num_kv_heads: 2
ffn_dim: 48
num_experts: 1
top_k: 1
vocab_size: 264
vocab_chunk: 264
max_seq_len: 32
causal: false
ffn_act: geglu
attention_window: 8
global_every: 2
objective: mlm
YAML
small_config "$W/byte.yaml" 32 2 48 32 # 256 ids: no <|end|>
check "$N" init --config "$W/dec.yaml" --out "$W/dec.safetensors" --seed 5
check "$N" init --config "$W/enc.yaml" --out "$W/enc.safetensors" --seed 5
check "$N" init --config "$W/byte.yaml" --out "$W/byte.safetensors" --seed 5
# documents of 2 to 40 bytes of the docs, each ended by <|end|>
$PY - "$NL_SOURCE_DIR/docs/cluster.md" "$W/docs.tok" <<'PY'
import random, struct, sys
text = open(sys.argv[1], "rb").read()
rng, ids, at = random.Random(7), [], 0
while len(ids) < 6000:
    n = rng.randint(2, 40)
    ids += list(text[at:at + n]) + [257]
    at += n
open(sys.argv[2], "wb").write(struct.pack("<%dI" % len(ids), *ids))
print("%d ids, %d documents" % (len(ids), ids.count(257)))
PY
printf 'red\tapple\nblue\tsea\nred\tcherry\nblue\tsky\n' > "$W/labels.tsv"

cat > "$W/cmp.py" <<'PY'
import json, struct, sys
def log(p):
    return {r["step"]: r for r in map(json.loads, open(p)) if "step" in r}
def tensors(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    return {k: b[8 + n + v["data_offsets"][0]: 8 + n + v["data_offsets"][1]]
            for k, v in h.items() if k != "__metadata__"}, h.get("__metadata__", {})
what = sys.argv[1]
if what == "logs":      # logs A B: every step's losses equal
    a, b = log(sys.argv[2]), log(sys.argv[3])
    assert sorted(a) == sorted(b) and a, (sorted(a), sorted(b))
    for k in b:
        for key in ("loss", "ce_loss", "eval_loss", "grad_norm"):
            assert (key in a[k]) == (key in b[k]), (k, key)
            if key in b[k]:
                assert a[k][key] == b[k][key], (k, key, a[k][key], b[k][key])
    print("%d steps: the losses are equal" % len(b))
elif what == "differ":  # differ A B: the first step's losses differ
    a, b = log(sys.argv[2]), log(sys.argv[3])
    assert a[1]["loss"] != b[1]["loss"], (a[1]["loss"], b[1]["loss"])
    print("step 1: loss %r packed, %r not" % (a[1]["loss"], b[1]["loss"]))
elif what == "weights":  # weights A B: every tensor bit for bit (and the step)
    (a, ma), (b, mb) = tensors(sys.argv[2]), tensors(sys.argv[3])
    assert set(a) == set(b), set(a) ^ set(b)
    diff = [k for k in b if a[k] != b[k]]
    assert not diff, "differ: %s" % diff[:5]
    assert ma.get("step") == mb.get("step"), (ma.get("step"), mb.get("step"))
    moved = [k for k in b if k.endswith("lora_B.weight") and any(b[k])]
    assert moved or not any(k.endswith("lora_B.weight") for k in b), "the adapters did not train"
    print("%d tensors: bit-identical" % len(b))
PY

# pair VERB NAME CLUSTER MODEL ARGS...: VERB (train or finetune) MODEL with
# ARGS in one process and through CLUSTER, into NAME_local.* and NAME.*;
# every step's losses and every tensor equal
pair() {
  local verb=$1 name=$2 cluster=$3 model=$4
  shift 4
  check "$N" "$verb" "${DEV[@]}" --model "$model" "$@" --threads 1 \
    --log "$W/${name}_local.jsonl" --out "$W/${name}_local.safetensors" 2> "$W/${name}_local.err"
  check "$N" "$verb" --cluster "$cluster" "$@" --checkpoint-dir "$W/ck_$name" \
    --log "$W/$name.jsonl" --out "$W/$name.safetensors" 2> "$W/$name.err"
  tail -n 3 "$W/$name.err"
  check $PY "$W/cmp.py" logs "$W/$name.jsonl" "$W/${name}_local.jsonl"
  check $PY "$W/cmp.py" weights "$W/$name.safetensors" "$W/${name}_local.safetensors"
}

# ---- clm and LoRA fine-tuning with packed rows on a decoder with experts ----
C="$W/c3"
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 3 --model "$W/dec.safetensors" --memory 64M \
  --threads 1 --node-timeout-ms 2000 --timeout 60
RUN=(--pack --data "$W/docs.tok" --steps 4 --batch 4 --seq 32 --microbatches 2 --lr 3e-3 --seed 1
     --eval-every 2 --eval-batches 2)
pair finetune ftp "$C" "$W/dec.safetensors" "${RUN[@]}" --lora-rank 4 --lora-alpha 8 \
  --lora-targets wq,wv,w_gate,w_down
pair train clmp "$C" "$W/dec.safetensors" "${RUN[@]}"
# both say how many documents the data holds, alike
ends=$(grep -o "packed rows: [1-9][0-9]* <|end|> ids in the data end documents" "$W/clmp_local.err")
echo "$ends"
check test -n "$ends"
check grep -qF "$ends" "$W/clmp.err"
# packing changes the run: the same without --pack learns otherwise
check "$N" train "${DEV[@]}" --model "$W/dec.safetensors" --data "$W/docs.tok" --steps 1 --batch 4 \
  --seq 32 --microbatches 2 --lr 3e-3 --seed 1 --threads 1 --log "$W/clm_flat.jsonl" --out "$W/clm_flat.safetensors" 2> /dev/null
check $PY "$W/cmp.py" differ "$W/clmp_local.jsonl" "$W/clm_flat.jsonl"
# refused: packed classification (each example is a row of its own)
out=$("$N" train --cluster "$C" --pack --objective classify --data "$W/labels.tsv" --steps 1 \
  --batch 2 --seq 8 --checkpoint-dir "$W/ck_bad" 2>&1); rc=$?
echo "$out" | tail -n 1
check test $rc -ne 0
check grep -q "params.pack: not with objective classify" <<< "$out"
check "$N" cluster down --dir "$C"

# ---- mlm with packed rows on an encoder ----
C="$W/c2"
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 2 --model "$W/enc.safetensors" --memory 64M \
  --threads 1 --node-timeout-ms 2000 --timeout 60
pair train mlmp "$C" "$W/enc.safetensors" "${RUN[@]}" --recompute
check grep -q "(objective mlm)" "$W/mlmp.err"
check "$N" cluster down --dir "$C"

# ---- local refusals ----
out=$("$N" train "${DEV[@]}" --model "$W/dec.safetensors" --pack --objective classify \
  --data "$W/labels.tsv" --steps 1 --batch 2 --seq 8 --checkpoint-dir "$W/ck_lc" 2>&1); rc=$?
check test $rc -ne 0
check grep -q -- "--pack: not with --objective classify" <<< "$out"
out=$("$N" train "${DEV[@]}" --model "$W/byte.safetensors" --pack --data "$W/docs.tok" --steps 1 \
  --batch 2 --seq 8 --checkpoint-dir "$W/ck_lb" 2>&1); rc=$?
check test $rc -ne 0
check grep -q "does not hold <|end|> (id 257)" <<< "$out"

echo "test_cluster_pack: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
