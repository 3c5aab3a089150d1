#!/usr/bin/env bash
# The training objectives on a cluster (issue 18), as real processes on
# loopback, each against neuroctl train in one process on the same
# checkpoint, seed, data and batches:
#  - mlm on an encoder (causal: false, geglu, dense FFN, alternating local
#    windows) over 3 nodes, its objective the config's: every step's loss
#    and eval loss, and the final weights and moments, bit for bit;
#  - classify (label<TAB>text, a classifier on mean-pooled states) over the
#    same 3 nodes: losses, the held-out accuracy (every held-out example
#    once) and the weights, bit for bit;
#  - LoRA fine-tuning (neuroctl finetune --cluster) with classify and mlm
#    (the config's) over the same 3 nodes, rank 4 on wq, wv and the dense
#    FFN's w_up: losses, held-out accuracy and the adapter file (with the
#    classifier head, trained by classify) bit for bit against neuroctl
#    finetune in one process, also when both run at once; the base
#    unchanged (a forward before and after); a forward through the cluster with the head-carrying adapter
#    equals the local one, and forward and embed ignore the head;
#  - classify fine-tuning on a decoder with 4 experts and a classifier
#    (adapters on wq, wv and every expert's w_gate and w_down) equals one
#    process bit for bit, and greedy generation through the cluster with
#    that adapter gives the local tool's ids;
#  - refusals, by name: classify on a model without num_classes (train and
#    finetune), mlm on a vocabulary without the mask id, a labelled file
#    with a bad line, an unknown objective, finetune --learn-vocab.
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20 # equal throughputs: 3 nodes make 3 stages

# an encoder with a classifier; its config trains masked tokens
cat > "$W/enc.yaml" <<'YAML'
hidden_dim: 32
num_layers: 3
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
num_classes: 3
YAML
small_config "$W/clm.yaml" 32 2 48 32 # a decoder: no classifier, no mask id
check "$N" init --config "$W/enc.yaml" --out "$W/enc.safetensors" --seed 5
check "$N" init --config "$W/clm.yaml" --out "$W/clm.safetensors" --seed 5
head -c 150000 "$CORPUS" > "$W/data.txt"
for i in $(seq 1 60); do
  printf 'red\tthe apple and the cherry %d\nblue\tthe sea and the sky %d\ngreen\tgrass and leaves %d\n' \
    "$i" "$i" "$i"
done > "$W/labels.tsv"
printf 'red\tapple\nno tab on this line\n' > "$W/broken.tsv"

cat > "$W/cmp.py" <<'PY'
import json, struct, sys
def log(p):
    return {r["step"]: r for r in map(json.loads, open(p)) if "step" in r}
def tensors(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    out = {}
    for k, v in h.items():
        if k == "__metadata__": continue
        s, e = v["data_offsets"]; out[k] = b[8 + n + s: 8 + n + e]
    return out, h.get("__metadata__", {})
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
elif what == "weights":  # weights A B: every tensor (weights and moments) bit for bit
    (a, ma), (b, mb) = tensors(sys.argv[2]), tensors(sys.argv[3])
    assert set(a) == set(b), set(a) ^ set(b)
    diff = [k for k in b if a[k] != b[k]]
    assert not diff, "differ: %s" % diff[:5]
    assert ma.get("step") == mb.get("step") and ma.get("adam_steps") == mb.get("adam_steps"), (ma, mb)
    print("%d tensors: bit-identical" % len(b))
elif what == "adapter":  # adapter A B [head]: every adapter tensor (and the head), bit for bit, and the metadata
    (a, ma), (b, mb) = tensors(sys.argv[2]), tensors(sys.argv[3])
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    assert ("classifier.weight" in b) == (sys.argv[4:] == ["head"]), sorted(b)
    for key in ("format", "rank", "alpha", "targets", "base_sha256"):
        assert ma.get(key) == mb.get(key), (key, ma.get(key), mb.get(key))
    diff = [k for k in b if a[k] != b[k]]
    assert not diff, "differ: %s" % diff[:5]
    moved = [k for k in b if k.endswith("lora_B.weight") and any(b[k])]
    assert moved, "the adapters did not train"
    print("%d adapter tensors%s: bit-identical, metadata equal" %
          (len(b), " (with the head)" if "classifier.weight" in b else ""))
elif what == "head":  # head ADAPTER MODEL moved|same: the adapter's classifier.weight against the base's
    (a, _), (b, _) = tensors(sys.argv[2]), tensors(sys.argv[3])
    assert (a["classifier.weight"] != b["classifier.weight"]) == (sys.argv[4] == "moved"), sys.argv[4]
    print("the adapter's head: %s" % ("trained" if sys.argv[4] == "moved" else "the base's"))
elif what == "strip":  # strip A OUT: A without classifier.weight
    b = open(sys.argv[2], "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    del h["classifier.weight"]
    data, off = b"", 0
    for k in sorted(k for k in h if k != "__metadata__"):
        s, e = h[k]["data_offsets"]; data += b[8 + n + s: 8 + n + e]
        h[k]["data_offsets"] = [off, off + e - s]; off += e - s
    hb = json.dumps(h).encode(); hb += b" " * (-len(hb) % 8)
    open(sys.argv[3], "wb").write(struct.pack("<Q", len(hb)) + hb + data)
elif what == "near":  # near A B NAME: tensor NAME within 1e-5 (relative, L2)
    (a, _), (b, _) = tensors(sys.argv[2]), tensors(sys.argv[3])
    x, y = (struct.unpack("<%df" % (len(t[sys.argv[4]]) // 4), t[sys.argv[4]]) for t in (a, b))
    assert len(x) == len(y), (len(x), len(y))
    num = sum((p - q) ** 2 for p, q in zip(x, y)) ** 0.5; den = sum(q * q for q in y) ** 0.5
    print("%s: relative error %.2e" % (sys.argv[4], num / den))
    assert num / den <= 1e-5, num / den
PY

C="$W/c3"
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 3 --model "$W/enc.safetensors" --memory 64M \
  --threads 1 --node-timeout-ms 2000 --timeout 60

# ---- LoRA fine-tuning with the objectives, on the frozen base (before
# anything trains it): classify, then mlm (the config's objective), each
# against neuroctl finetune in one process; rank 4 on wq, wv and the dense
# FFN's one expert's w_up; the last stage's adapters carry the trained
# classifier head, as the local adapter file does ----
$PY - "$W" <<'PY'
import json, struct, sys
toks = [(i * 37 + 11) % 256 for i in range(21)]
h = json.dumps({"tokens": {"dtype": "I32", "shape": [1, 21], "data_offsets": [0, 4 * len(toks)]}}).encode()
h += b" " * (-len(h) % 8)
open(sys.argv[1] + "/in.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + struct.pack("<%di" % len(toks), *toks))
PY
check "$N" forward --cluster "$C" --tokens "$W/in.safetensors" --out "$W/before.safetensors"
LORA=(--lora-rank 4 --lora-alpha 8 --lora-targets wq,wv,w_up)
FCLS=(--objective classify --data "$W/labels.tsv" --steps 6 --batch 6 --seq 16 --microbatches 2
      --lr 3e-3 --seed 3 --eval-every 3)
# both VERB NAME ARGS...: VERB (train or finetune) the encoder with ARGS in
# one process and through the cluster, into NAME_local.* and NAME.*; every
# step's losses equal
both() {
  local verb=$1 name=$2
  shift 2
  check "$N" "$verb" "${DEV[@]}" --model "$W/enc.safetensors" "$@" --threads 1 \
    --log "$W/${name}_local.jsonl" --out "$W/${name}_local.safetensors" 2> "$W/${name}_local.err"
  check "$N" "$verb" --cluster "$C" "$@" --checkpoint-dir "$W/ck_$name" \
    --log "$W/$name.jsonl" --out "$W/$name.safetensors" 2> "$W/$name.err"
  cat "$W/$name.err"
  check $PY "$W/cmp.py" logs "$W/$name.jsonl" "$W/${name}_local.jsonl"
}
both finetune ftc "${FCLS[@]}" "${LORA[@]}"
check $PY "$W/cmp.py" adapter "$W/ftc.safetensors" "$W/ftc_local.safetensors" head
check grep -q "on 162 examples into 3 classes (18 held out).*(objective classify)" "$W/ftc.err"
acc_local=$(grep -o 'held-out accuracy [0-9.]*' "$W/ftc_local.err" | cut -d' ' -f3 | tr '\n' ' ')
acc=$(grep -o 'held-out accuracy [0-9.]*' "$W/ftc.err" | cut -d' ' -f3 | tr '\n' ' ')
echo "fine-tuned held-out accuracy: cluster $acc, one process $acc_local"
check test -n "$acc"
check test "$acc" = "$acc_local"
FMLM=(--data "$W/data.txt" --steps 4 --batch 4 --seq 32 --microbatches 2 --lr 3e-3 --seed 1
      --eval-every 2 --eval-batches 2)
both finetune ftm "${FMLM[@]}" "${LORA[@]}"
check $PY "$W/cmp.py" adapter "$W/ftm.safetensors" "$W/ftm_local.safetensors" head
check grep -q "on 3 pipeline stages.*(objective mlm)" "$W/ftm.err"
# both at once on the same stages (each job's adapters and head its own):
# each equals its solo run
"$N" finetune --cluster "$C" "${FCLS[@]}" "${LORA[@]}" --checkpoint-dir "$W/ck_both" \
  --log "$W/bothc.jsonl" --out "$W/bothc.safetensors" 2> "$W/bothc.err" &
pc=$!
"$N" finetune --cluster "$C" "${FMLM[@]}" "${LORA[@]}" --checkpoint-dir "$W/ck_both" \
  --log "$W/bothm.jsonl" --out "$W/bothm.safetensors" 2> "$W/bothm.err" &
pm=$!
wait $pc; rc_c=$?
wait $pm; rc_m=$?
check test "$rc_c" -eq 0
check test "$rc_m" -eq 0
check $PY "$W/cmp.py" logs "$W/bothc.jsonl" "$W/ftc_local.jsonl"
check $PY "$W/cmp.py" adapter "$W/bothc.safetensors" "$W/ftc.safetensors" head
check $PY "$W/cmp.py" logs "$W/bothm.jsonl" "$W/ftm_local.jsonl"
check $PY "$W/cmp.py" adapter "$W/bothm.safetensors" "$W/ftm.safetensors" head
# the base is frozen: the same forward through every stage, bit for bit
check "$N" forward --cluster "$C" --tokens "$W/in.safetensors" --out "$W/after.safetensors"
check cmp "$W/before.safetensors" "$W/after.safetensors"
# the head: classify trained it, mlm left the base's
check $PY "$W/cmp.py" head "$W/ftc.safetensors" "$W/enc.safetensors" moved
check $PY "$W/cmp.py" head "$W/ftm.safetensors" "$W/enc.safetensors" same
# an adapter with the head, applied through the cluster (the file the
# cluster joined): forward gives the language-model logits, as the local
# tool does; forward and embed (the pooled states) do not read the head,
# so the same adapter without it gives the same bytes; embed --cluster
# with it equals the local embed (this model has no tokenizer: bytes, as
# locally)
ADC=$(ls "$W"/ck_ftc/lora-job*/adapter.safetensors | head -n 1)
$PY "$W/cmp.py" strip "$W/ftc.safetensors" "$W/ftc_nohead.safetensors"
check "$N" forward --cluster "$C" --adapter "$ADC" --tokens "$W/in.safetensors" \
  --out "$W/fwdc_remote.safetensors"
check "$N" forward "${DEV[@]}" --model "$W/enc.safetensors" --adapter "$W/ftc.safetensors" \
  --tokens "$W/in.safetensors" --out "$W/fwdc_local.safetensors" --threads 1
check "$N" forward "${DEV[@]}" --model "$W/enc.safetensors" --adapter "$W/ftc_nohead.safetensors" \
  --tokens "$W/in.safetensors" --out "$W/fwdc_nohead.safetensors" --threads 1
check $PY "$W/cmp.py" near "$W/fwdc_remote.safetensors" "$W/fwdc_local.safetensors" logits
check cmp "$W/fwdc_local.safetensors" "$W/fwdc_nohead.safetensors"
check $PY - "$W" <<'PY'
import sys  # the adapter changed the logits
w = sys.argv[1]
assert open(w + "/fwdc_local.safetensors", "rb").read() != open(w + "/before.safetensors", "rb").read()
PY
cut -f2 "$W/labels.tsv" | head -n 5 > "$W/texts.txt"
check "$N" embed "${DEV[@]}" --model "$W/enc.safetensors" --adapter "$W/ftc.safetensors" \
  --input "$W/texts.txt" --seq 16 --batch 1 --threads 1 --out "$W/embc_local.safetensors"
check "$N" embed "${DEV[@]}" --model "$W/enc.safetensors" --adapter "$W/ftc_nohead.safetensors" \
  --input "$W/texts.txt" --seq 16 --batch 1 --threads 1 --out "$W/embc_nohead.safetensors"
check cmp "$W/embc_local.safetensors" "$W/embc_nohead.safetensors"
check "$N" embed --cluster "$C" --adapter "$ADC" --input "$W/texts.txt" --seq 16 --batch 1 \
  --out "$W/embc_remote.safetensors"
check $PY "$W/cmp.py" near "$W/embc_remote.safetensors" "$W/embc_local.safetensors" embeddings

# ---- mlm (the config's objective): 3 nodes against one process ----
MLM=(--data "$W/data.txt" --steps 4 --batch 4 --seq 32 --microbatches 2 --lr 3e-3 --seed 1
     --eval-every 2 --eval-batches 2)
both train mlm "${MLM[@]}"
check grep -q "on 3 pipeline stages.*(objective mlm)" "$W/mlm.err"
check $PY "$W/cmp.py" weights "$W/mlm.safetensors" "$W/mlm_local.safetensors"

# ---- classify: labelled examples through the pipeline (a cluster of the
# untrained model again: the one above holds what mlm trained) ----
check "$N" cluster down --dir "$C"
C="$W/c3b"
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 3 --model "$W/enc.safetensors" --memory 64M \
  --threads 1 --node-timeout-ms 2000 --timeout 60
CLS=(--objective classify --data "$W/labels.tsv" --steps 6 --batch 6 --seq 16 --microbatches 2
     --lr 3e-3 --seed 2 --eval-every 3)
both train cls "${CLS[@]}"
check grep -q "on 162 examples into 3 classes (18 held out).*(objective classify)" "$W/cls.err"
check $PY "$W/cmp.py" weights "$W/cls.safetensors" "$W/cls_local.safetensors"
acc_local=$(grep -o 'held-out accuracy [0-9.]*' "$W/cls_local.err" | cut -d' ' -f3 | tr '\n' ' ')
acc=$(grep -o 'held-out accuracy [0-9.]*' "$W/cls.err" | cut -d' ' -f3 | tr '\n' ' ')
echo "held-out accuracy: cluster $acc, one process $acc_local"
check test -n "$acc"
check test "$acc" = "$acc_local"

# ---- refusals ----
out=$("$N" train --cluster "$C" --objective classify --data "$W/broken.tsv" --steps 1 --batch 2 \
  --seq 8 --checkpoint-dir "$W/ck_bad" 2>&1); rc=$?
echo "$out" | tail -1
check test $rc -ne 0
check grep -q "broken.tsv:2: expected label<TAB>text" <<< "$out"
printf 'red\tapple\nblue\tsea\n' > "$W/two.tsv" # 10% of 2 examples: none held out
out=$("$N" train --cluster "$C" --objective classify --data "$W/two.tsv" --steps 1 --batch 2 \
  --seq 8 --eval-every 1 --checkpoint-dir "$W/ck_two" 2>&1); rc=$?
echo "$out" | tail -1
check test $rc -ne 0
check grep -q "two.tsv: holdout 0.1 of 2 examples holds none out to evaluate" <<< "$out"
out=$("$N" train "${DEV[@]}" --model "$W/enc.safetensors" --objective classify --data "$W/two.tsv" \
  --steps 1 --batch 2 --seq 8 --eval-every 1 --checkpoint-dir "$W/ck_two_local" 2>&1); rc=$?
check test $rc -ne 0
check grep -q "two.tsv: holdout 0.1 of 2 examples holds none out to evaluate" <<< "$out"
out=$("$N" train --cluster "$C" --objective next --data "$W/data.txt" --steps 1 2>&1); rc=$?
check test $rc -eq 2
check grep -q "'next' is not clm, mlm or classify" <<< "$out"
check "$N" cluster down --dir "$C"

# ---- classify fine-tuning on a decoder with 4 experts (top 2) and a
# classifier: adapters on wq, wv and every expert's w_gate and w_down, the
# batch's expert shares first (COUNT hops with the documents); then greedy
# generation through the cluster with that adapter (it carries the head,
# which generation does not read) equals the local one ----
small_config "$W/moe.yaml" 32 3 48 32
echo "num_classes: 3" >> "$W/moe.yaml"
check "$N" init --config "$W/moe.yaml" --out "$W/moe.safetensors" --seed 6
CM="$W/c3moe"
check "$N" cluster up "${DEV[@]}" --dir "$CM" --nodes 3 --model "$W/moe.safetensors" --memory 64M \
  --threads 1 --node-timeout-ms 2000 --timeout 60
LORAE=(--lora-rank 4 --lora-alpha 8 --lora-targets wq,wv,w_gate,w_down)
check "$N" finetune "${DEV[@]}" --model "$W/moe.safetensors" "${FCLS[@]}" "${LORAE[@]}" \
  --threads 1 --log "$W/fte_local.jsonl" --out "$W/fte_local.safetensors" 2> "$W/fte_local.err"
check "$N" finetune --cluster "$CM" "${FCLS[@]}" "${LORAE[@]}" --checkpoint-dir "$W/ck_fte" \
  --log "$W/fte.jsonl" --out "$W/fte.safetensors" 2> "$W/fte.err"
cat "$W/fte.err"
check grep -q "(objective classify)" "$W/fte.err"
check $PY "$W/cmp.py" logs "$W/fte.jsonl" "$W/fte_local.jsonl"
check $PY "$W/cmp.py" adapter "$W/fte.safetensors" "$W/fte_local.safetensors" head
check $PY "$W/cmp.py" head "$W/fte.safetensors" "$W/moe.safetensors" moved
acc_local=$(grep -o 'held-out accuracy [0-9.]*' "$W/fte_local.err" | cut -d' ' -f3 | tr '\n' ' ')
acc=$(grep -o 'held-out accuracy [0-9.]*' "$W/fte.err" | cut -d' ' -f3 | tr '\n' ' ')
check test -n "$acc"
check test "$acc" = "$acc_local"
AE=$(ls "$W"/ck_fte/lora-job*/adapter.safetensors | head -n 1)
G=(--prompt-tokens 5,6,7,8,9,10,11,12 --max-new 12 --temperature 0)
"$N" generate --cluster "$CM" --adapter "$AE" "${G[@]}" 2> /dev/null | head -n 1 > "$W/gen_remote.txt"
"$N" generate "${DEV[@]}" --model "$W/moe.safetensors" --adapter "$W/fte.safetensors" "${G[@]}" \
  --threads 1 2> /dev/null | head -n 1 > "$W/gen_local.txt"
echo "generated with the adapter: $(cat "$W/gen_remote.txt")"
check test "$(wc -w < "$W/gen_remote.txt")" -eq 12
check cmp "$W/gen_remote.txt" "$W/gen_local.txt"
check "$N" cluster down --dir "$CM"

C2="$W/c2"
check "$N" cluster up "${DEV[@]}" --dir "$C2" --nodes 2 --model "$W/clm.safetensors" --memory 64M \
  --threads 1 --node-timeout-ms 2000 --timeout 60
out=$("$N" train --cluster "$C2" --objective classify --data "$W/labels.tsv" --steps 1 --batch 2 \
  --seq 8 --checkpoint-dir "$W/ck_nc" 2>&1); rc=$?
echo "$out" | tail -1
check test $rc -ne 0
check grep -q "has no classifier (set num_classes" <<< "$out"
out=$("$N" finetune --cluster "$C2" --objective classify --data "$W/labels.tsv" --steps 1 \
  --batch 2 --seq 8 --checkpoint-dir "$W/ck_fnc" --out "$W/never.safetensors" 2>&1); rc=$?
echo "$out" | tail -1
check test $rc -ne 0
check grep -q "has no classifier (set num_classes" <<< "$out"
check test ! -e "$W/never.safetensors"
out=$("$N" finetune --cluster "$C2" --learn-vocab 300 --data "$W/data.txt" --steps 1 --batch 2 \
  --seq 8 --out "$W/never.safetensors" 2>&1); rc=$?
check test $rc -eq 2
check grep -q "learn-vocab" <<< "$out"
out=$("$N" train --cluster "$C2" --objective mlm --data "$W/data.txt" --steps 1 --batch 2 \
  --seq 8 --checkpoint-dir "$W/ck_nm" 2>&1); rc=$?
echo "$out" | tail -1
check test $rc -ne 0
check grep -q "does not hold the mask id" <<< "$out"
check "$N" cluster down --dir "$C2"

echo "test_cluster_objectives: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
