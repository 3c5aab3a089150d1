#!/usr/bin/env bash
# LoRA fine-tuning through a frozen 3-node pipeline (issue 18, item 3):
#  - parity: neuroctl finetune --cluster equals neuroctl finetune in one
#    process on the same base, data, seed and batches: every step's loss
#    and eval loss, and every adapter tensor, within 1e-5 (relative); the
#    joined file carries the local file's metadata (rank, alpha, targets,
#    the base's SHA-256);
#  - the base is frozen: a forward through the cluster before and after
#    the fine-tuning jobs is bit-identical (every stage computes it);
#  - two clients fine-tune different adapters on the pipeline at once, and
#    each gets what it got alone;
#  - adapters on the experts' w_gate, w_up, w_down too (with wq, wo):
#    the cluster equals one process step for step;
#  - a training job is refused while a fine-tuning job runs;
#  - forward and generate through the cluster with an adapter (params.
#    adapter, every stage applies its layers' part) equal the local tools
#    with --adapter; adapter-less generations running at the same time
#    (batched on the stages, while the adapter's session runs alone) are
#    unchanged;
#  - an adapter of another checkpoint is refused by the coordinator, naming
#    both hashes, for generate, forward and embed;
#  - embeddings through the cluster (neuroctl embed --cluster) equal local
#    ones within 1e-5, for a decoder (also with the joined adapter) and for
#    an encoder (pads kept out of attention on every stage).
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20 # equal probes: the plan is 3 stages whatever else runs

small_config "$W/cfg.yaml" 32 6 48 64
cp "$CORPUS" "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
RUN=(--data "$W/data.txt" --steps 6 --batch 8 --seq 32 --microbatches 4 --lr 3e-3
     --eval-every 3 --eval-batches 2)
A=(--seed 1 --lora-rank 8 --lora-alpha 16)
B=(--seed 2 --lora-rank 4 --lora-alpha 8 --lora-targets wq,wv)
E=(--seed 3 --lora-rank 4 --lora-alpha 8 --lora-targets wq,wo,w_gate,w_up,w_down)

cat > "$W/cmp.py" <<'PY'
import json, struct, sys
def log(p):
    return {r["step"]: r for r in map(json.loads, open(p)) if "step" in r}
def tensors(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    out = {}
    for k, v in h.items():
        if k == "__metadata__": continue
        s, e = v["data_offsets"]; raw = b[8 + n + s: 8 + n + e]
        out[k] = struct.unpack("<%df" % (len(raw) // 4), raw)
    return out, h.get("__metadata__", {})
def rel(a, b):
    num = sum((x - y) ** 2 for x, y in zip(a, b)); den = sum(y * y for y in b)
    return (num / den) ** 0.5 if den else num ** 0.5
what = sys.argv[1]
if what == "logs":      # logs A B LAST: losses of steps 1..LAST
    a, b = log(sys.argv[2]), log(sys.argv[3])
    worst = 0.0
    for k in range(1, int(sys.argv[4]) + 1):
        for key in ("loss", "ce_loss", "eval_loss"):
            if key in b[k]:
                e = abs(a[k][key] - b[k][key]) / abs(b[k][key]); worst = max(worst, e)
                assert e <= 1e-5, (k, key, a[k][key], b[k][key])
    print("losses of steps 1..%s: worst relative error %.2e" % (sys.argv[4], worst))
elif what == "adapter":  # adapter A B: every tensor and the metadata
    (a, ma), (b, mb) = tensors(sys.argv[2]), tensors(sys.argv[3])
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in b), sorted(b)
    for key in ("format", "rank", "alpha", "targets", "base_sha256"):
        assert ma.get(key) == mb.get(key), (key, ma.get(key), mb.get(key))
    worst = max(rel(a[k], b[k]) for k in b)
    moved = max(max(abs(x) for x in b[k]) for k in b if k.endswith("lora_B.weight"))
    print("%d adapter tensors: worst relative error %.2e (B moved to %.3g)" % (len(b), worst, moved))
    assert worst <= 1e-5, worst
    assert moved > 0, "the adapters did not train"
PY
# the forward this test compares before and after (3 sequences of 21 ids)
$PY - "$W" <<'PY'
import json, struct, sys
toks = [(i * 37 + 11) % 256 for i in range(3 * 21)]
h = json.dumps({"tokens": {"dtype": "I32", "shape": [3, 21], "data_offsets": [0, 4 * len(toks)]}}).encode()
h += b" " * (-len(h) % 8)
open(sys.argv[1] + "/in.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + struct.pack("<%di" % len(toks), *toks))
PY

# ---- the references: one process each ----
check "$N" finetune "${DEV[@]}" --model "$W/m.safetensors" "${RUN[@]}" "${A[@]}" --threads 1 \
  --log "$W/localA.jsonl" --out "$W/localA.safetensors" 2> "$W/localA.err"
check "$N" finetune "${DEV[@]}" --model "$W/m.safetensors" "${RUN[@]}" "${B[@]}" --threads 1 \
  --log "$W/localB.jsonl" --out "$W/localB.safetensors" 2> "$W/localB.err"
check "$N" finetune "${DEV[@]}" --model "$W/m.safetensors" "${RUN[@]}" "${E[@]}" --threads 1 \
  --log "$W/localE.jsonl" --out "$W/localE.safetensors" 2> "$W/localE.err"

# ---- the cluster ----
C="$W/c3"
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 3 --model "$W/m.safetensors" --memory 64M \
  --threads 1 --node-timeout-ms 2000 --timeout 60
check "$N" forward --cluster "$C" --tokens "$W/in.safetensors" --out "$W/before.safetensors"

# parity: adapter A alone
check "$N" finetune --cluster "$C" "${RUN[@]}" "${A[@]}" --checkpoint-dir "$W/ck" \
  --log "$W/remoteA.jsonl" --out "$W/remoteA.safetensors" 2> "$W/remoteA.err"
cat "$W/remoteA.err"
check grep -q "on 3 pipeline stages" "$W/remoteA.err"
check $PY "$W/cmp.py" logs "$W/remoteA.jsonl" "$W/localA.jsonl" 6
check $PY "$W/cmp.py" adapter "$W/remoteA.safetensors" "$W/localA.safetensors"
check test "$(ls "$W"/ck/lora-job*/stage-*.safetensors | wc -l)" -eq 3
# the joined file is an ordinary adapter file: the local tools apply it
check "$N" forward "${DEV[@]}" --model "$W/m.safetensors" --adapter "$W/remoteA.safetensors" \
  --tokens "$W/in.safetensors" --out "$W/fwdA.safetensors" --threads 1

# expert targets: every expert's w_gate, w_up, w_down adapted on its stage
check "$N" finetune --cluster "$C" "${RUN[@]}" "${E[@]}" --checkpoint-dir "$W/ckE" \
  --log "$W/remoteE.jsonl" --out "$W/remoteE.safetensors" 2> "$W/remoteE.err"
check $PY "$W/cmp.py" logs "$W/remoteE.jsonl" "$W/localE.jsonl" 6
check $PY "$W/cmp.py" adapter "$W/remoteE.safetensors" "$W/localE.safetensors"
check $PY - "$W/remoteE.safetensors" <<'PY'
import json, struct, sys
b = open(sys.argv[1], "rb").read(); h = json.loads(b[8:8 + struct.unpack("<Q", b[:8])[0]])
for l in range(6):  # every layer, every one of the 4 experts
    for e in range(4):
        for t in ("w_gate", "w_up", "w_down"):
            assert "layers.%d.moe.experts.%d.%s.lora_B.weight" % (l, e, t) in h, (l, e, t)
PY

# two adapters at once, each as it was alone
"$N" finetune --cluster "$C" "${RUN[@]}" "${A[@]}" --checkpoint-dir "$W/ck2" \
  --log "$W/bothA.jsonl" --out "$W/bothA.safetensors" 2> "$W/bothA.err" &
pa=$!
"$N" finetune --cluster "$C" "${RUN[@]}" "${B[@]}" --checkpoint-dir "$W/ck2" \
  --log "$W/bothB.jsonl" --out "$W/bothB.safetensors" 2> "$W/bothB.err" &
pb=$!
wait $pa; rc_a=$?
wait $pb; rc_b=$?
cat "$W/bothA.err" "$W/bothB.err"
check test "$rc_a" -eq 0
check test "$rc_b" -eq 0
check $PY "$W/cmp.py" logs "$W/bothA.jsonl" "$W/localA.jsonl" 6
check $PY "$W/cmp.py" adapter "$W/bothA.safetensors" "$W/remoteA.safetensors"
check $PY "$W/cmp.py" logs "$W/bothB.jsonl" "$W/localB.jsonl" 6
check $PY "$W/cmp.py" adapter "$W/bothB.safetensors" "$W/localB.safetensors"

# a training job would change the weights under a fine-tuning job: refused
# while one runs (a long one, cancelled with Ctrl-C afterwards)
"$N" finetune --cluster "$C" --data "$W/data.txt" --steps 100000 --batch 8 --seq 32 \
  --checkpoint-dir "$W/ck3" --log "$W/long.jsonl" --out "$W/long.safetensors" 2> "$W/long.err" &
pl=$!
for _ in $(seq 600); do [ -s "$W/long.jsonl" ] && break; sleep 0.1; done
check test -s "$W/long.jsonl"
"$N" train --cluster "$C" "${RUN[@]}" --seed 1 --out "$W/never.safetensors" 2> "$W/refused.err"
check test $? -ne 0
check grep -q "fine-tuning" "$W/refused.err"
check test ! -e "$W/never.safetensors"
kill -INT $pl
wait $pl
check test $? -eq 130
# Ctrl-C keeps the adapters trained so far in --out, as local fine-tuning does
tr '\r' '\n' < "$W/long.err" | grep -v "^step" | tail -3
check grep -q "interrupted after step [0-9]* of 100000: kept the adapters in $W/long.safetensors" \
  "$W/long.err"
check test -s "$W/long.safetensors"

# the base is frozen: the same forward, bit for bit
check "$N" forward --cluster "$C" --tokens "$W/in.safetensors" --out "$W/after.safetensors"
check cmp "$W/before.safetensors" "$W/after.safetensors"
# and the forward with the adapter differs from the base's
check $PY - "$W" <<'PY'
import sys
w = sys.argv[1]
assert open(w + "/fwdA.safetensors", "rb").read() != open(w + "/before.safetensors", "rb").read()
PY

# ---- embeddings through the cluster (item 4) ----
# lines of several lengths, one empty, more than a batch: equal to one process
head -c 3000 "$CORPUS" | tr -s ' ' | head -n 23 > "$W/texts.txt"
printf '\nshort\n' >> "$W/texts.txt"
check "$N" embed "${DEV[@]}" --model "$W/m.safetensors" --input "$W/texts.txt" --seq 40 --batch 4 \
  --threads 1 --out "$W/emb_local.safetensors"
# (--memory 64M leaves these nodes one sequence of max_seq_len per forward)
check "$N" embed --cluster "$C" --input "$W/texts.txt" --seq 40 --batch 1 --out "$W/emb_remote.safetensors"
cat > "$W/emb.py" <<'PY'
import json, struct, sys
def emb(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    v = h["embeddings"]; s, e = v["data_offsets"]; raw = b[8 + n + s: 8 + n + e]
    return v["shape"], struct.unpack("<%df" % (len(raw) // 4), raw)
(sa, a), (sb, b) = emb(sys.argv[1]), emb(sys.argv[2])
assert sa == sb, (sa, sb)
d = sa[1]; worst = 0.0
for i in range(sa[0]):
    x, y = a[i * d:(i + 1) * d], b[i * d:(i + 1) * d]
    num = sum((p - q) ** 2 for p, q in zip(x, y)) ** 0.5; den = sum(q * q for q in y) ** 0.5
    worst = max(worst, num / den)
    assert abs(den - 1) < 1e-4, den  # L2-normalised
print("%d embeddings of %d: worst relative error %.2e" % (sa[0], d, worst))
assert worst <= 1e-5, worst
PY
check $PY "$W/emb.py" "$W/emb_remote.safetensors" "$W/emb_local.safetensors"
# with the adapter the cluster joined (under its checkpoint root), against
# the local tool with the client's copy of it
AD=$(ls "$W"/ck/lora-job*/adapter.safetensors | head -n 1)
check "$N" embed "${DEV[@]}" --model "$W/m.safetensors" --adapter "$W/remoteA.safetensors" \
  --input "$W/texts.txt" --seq 40 --batch 4 --threads 1 --out "$W/embA_local.safetensors"
check "$N" embed --cluster "$C" --adapter "$AD" --input "$W/texts.txt" --seq 40 --batch 1 \
  --out "$W/embA_remote.safetensors"
check $PY "$W/emb.py" "$W/embA_remote.safetensors" "$W/embA_local.safetensors"
check $PY - "$W" <<'PY'
import sys
w = sys.argv[1]  # the adapter changed the embeddings
assert open(w + "/embA_local.safetensors", "rb").read() != open(w + "/emb_local.safetensors", "rb").read()
PY
# an encoder (bidirectional: the pads are kept out of attention on every stage)
sed 's/^max_seq_len: 64/max_seq_len: 64\ncausal: false/' "$W/cfg.yaml" > "$W/enc.yaml"
check "$N" init --config "$W/enc.yaml" --out "$W/enc.safetensors" --seed 9
check "$N" embed "${DEV[@]}" --model "$W/enc.safetensors" --input "$W/texts.txt" --seq 40 --batch 4 \
  --threads 1 --out "$W/enc_local.safetensors"
CE="$W/c2enc"
"$N" cluster up "${DEV[@]}" --dir "$CE" --nodes 2 --model "$W/enc.safetensors" --memory 512M \
  --threads 1 --node-timeout-ms 2000 --timeout 60 > "$W/enc_up.err" 2>&1
check grep -q "ready: 2 stages" "$W/enc_up.err"
check "$N" embed --cluster "$CE" --input "$W/texts.txt" --seq 40 --batch 4 --out "$W/enc_remote.safetensors"
check $PY "$W/emb.py" "$W/enc_remote.safetensors" "$W/enc_local.safetensors"
"$N" cluster down --dir "$CE" > /dev/null 2>&1

# ---- forward and generate through the cluster with an adapter ----
# the expert adapter as the cluster joined it (under its checkpoint root),
# against the local tools with the client's copy
AE=$(ls "$W"/ckE/lora-job*/adapter.safetensors | head -n 1)
check "$N" forward "${DEV[@]}" --model "$W/m.safetensors" --adapter "$W/remoteE.safetensors" \
  --tokens "$W/in.safetensors" --out "$W/fwdE_local.safetensors" --threads 1
check "$N" forward --cluster "$C" --adapter "$AE" --tokens "$W/in.safetensors" \
  --out "$W/fwdE_remote.safetensors"
cat > "$W/logits.py" <<'PY'
import json, struct, sys
def t(p, name):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    v = h[name]; s, e = v["data_offsets"]; raw = b[8 + n + s: 8 + n + e]
    return v["shape"], struct.unpack("<%df" % (len(raw) // 4), raw)
(sa, a), (sb, b) = t(sys.argv[1], "logits"), t(sys.argv[2], "logits")
assert sa == sb, (sa, sb)
num = sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5; den = sum(y * y for y in b) ** 0.5
xa, xb = t(sys.argv[1], "aux_loss")[1][0], t(sys.argv[2], "aux_loss")[1][0]
print("logits %s: relative error %.2e (%s); aux loss %.2e" %
      (sa, num / den, "bit-identical" if a == b else "not bit-identical", abs(xa - xb) / abs(xb)))
assert num / den <= 1e-5 and abs(xa - xb) <= 1e-5 * abs(xb)
PY
check $PY "$W/logits.py" "$W/fwdE_remote.safetensors" "$W/fwdE_local.safetensors"
check "$N" forward "${DEV[@]}" --model "$W/m.safetensors" --tokens "$W/in.safetensors" \
  --out "$W/fwd_local.safetensors" --threads 1
check $PY - "$W" <<'PY'
import sys  # the adapter changed the logits
w = sys.argv[1]
assert open(w + "/fwdE_local.safetensors", "rb").read() != open(w + "/fwd_local.safetensors", "rb").read()
PY
# generate, greedy: the same ids as local generate --adapter, for the
# attention adapter A and the expert one; meanwhile adapter-less seeded
# sampled generations (batched on the stages) give what they give alone
P=5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24
G=(--prompt-tokens $P --max-new 24)
gen_ids() { "$@" 2> /dev/null | head -n 1; }
gen_ids "$N" generate "${DEV[@]}" --model "$W/m.safetensors" --adapter "$W/remoteA.safetensors" \
  "${G[@]}" --temperature 0 --threads 1 > "$W/genA_local.txt"
gen_ids "$N" generate "${DEV[@]}" --model "$W/m.safetensors" --adapter "$W/remoteE.safetensors" \
  "${G[@]}" --temperature 0 --threads 1 > "$W/genE_local.txt"
gen_ids "$N" generate "${DEV[@]}" --model "$W/m.safetensors" "${G[@]}" --temperature 0 \
  --threads 1 > "$W/genbase_local.txt"
gen_ids "$N" generate --cluster "$C" "${G[@]}" --temperature 0.9 --seed 5 > "$W/gen0_solo.txt"
check test "$(wc -w < "$W/gen0_solo.txt")" -eq 24
pids=()
for i in 1 2; do
  gen_ids "$N" generate --cluster "$C" --adapter "$AD" "${G[@]}" --temperature 0 > "$W/genA_$i.txt" &
  pids+=($!)
  gen_ids "$N" generate --cluster "$C" --adapter "$AE" "${G[@]}" --temperature 0 > "$W/genE_$i.txt" &
  pids+=($!)
  gen_ids "$N" generate --cluster "$C" "${G[@]}" --temperature 0.9 --seed 5 > "$W/gen0_$i.txt" &
  pids+=($!)
done
wait "${pids[@]}"
for i in 1 2; do
  check cmp "$W/genA_$i.txt" "$W/genA_local.txt"
  check cmp "$W/genE_$i.txt" "$W/genE_local.txt"
  check cmp "$W/gen0_$i.txt" "$W/gen0_solo.txt"
done
check test "$(wc -w < "$W/genA_local.txt")" -eq 24
check $PY - "$W" <<'PY'
import sys  # the adapters changed what is generated
w = sys.argv[1]
a, e, z = (open(w + f).read() for f in ("/genA_local.txt", "/genE_local.txt", "/genbase_local.txt"))
assert a != z and e != z and a != e, (a, e, z)
PY
# every stage loaded each adapter file once (its cache), for forward, generate and embed
for n in "$C"/node-*.log; do
  check test "$(grep -c "adapter .*ckE/lora-job.*loaded" "$n")" -eq 1
done
# a file that is not an adapter: refused (the coordinator reads it first, to
# compare its base), the job fails saying so
"$N" generate --cluster "$C" --adapter "$W/data.txt" "${G[@]}" 2> "$W/noad.err"
check test $? -ne 0
check grep -q "params.adapter" "$W/noad.err"
"$N" forward --cluster "$C" --adapter "$W/data.txt" --tokens "$W/in.safetensors" \
  --out "$W/never.safetensors" 2> "$W/noad2.err"
check test $? -ne 0
check grep -q "params.adapter" "$W/noad2.err"

# an adapter of another checkpoint: the coordinator refuses it before any
# stage applies it, naming both hashes (generate, forward, embed); it
# hashed the model file once, for the first job that named an adapter
check "$N" init --config "$W/cfg.yaml" --out "$W/other.safetensors" --seed 8
check "$N" finetune "${DEV[@]}" --model "$W/other.safetensors" --data "$W/data.txt" --steps 1 \
  --batch 2 --seq 16 --threads 1 --out "$W/ck/other-adapter.safetensors" 2> /dev/null
OTHER="SHA-256 $(sha256sum "$W/other.safetensors" | cut -c1-12)"
MINE="SHA-256 $(sha256sum "$W/m.safetensors" | cut -c1-12)"
"$N" generate --cluster "$C" --adapter "$W/ck/other-adapter.safetensors" "${G[@]}" 2> "$W/other1.err"
check test $? -ne 0
"$N" forward --cluster "$C" --adapter "$W/ck/other-adapter.safetensors" \
  --tokens "$W/in.safetensors" --out "$W/never.safetensors" 2> "$W/other2.err"
check test $? -ne 0
"$N" embed --cluster "$C" --adapter "$W/ck/other-adapter.safetensors" --input "$W/texts.txt" \
  --seq 40 --batch 1 --out "$W/never.safetensors" 2> "$W/other3.err"
check test $? -ne 0
for k in 1 2 3; do
  cat "$W/other$k.err"
  check grep -q "params.adapter: .*other-adapter.safetensors: an adapter of the checkpoint with $OTHER" "$W/other$k.err"
  check grep -q "not of .*m.safetensors ($MINE" "$W/other$k.err"
done
check test ! -e "$W/never.safetensors"
check test "$(grep -c "adapters named by jobs are checked against .*m.safetensors ($MINE" "$C/coord.log")" -eq 1

# refusals: a bad target, and finetune without --out
"$N" finetune --cluster "$C" "${RUN[@]}" --lora-targets wz --out "$W/x.safetensors" 2> "$W/bad.err"
check test $? -eq 2
check grep -q "wz" "$W/bad.err"
"$N" finetune --cluster "$C" "${RUN[@]}" 2> "$W/noout.err"
check test $? -eq 2

echo "test_cluster_lora: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
