#!/usr/bin/env bash
# DiLoCo across replica groups (DESIGN section 8; neurocoord --outer-every):
# 4 nodes as 2 stages x 2 replicas, H = 5, 10 steps
#  - the cluster's every step's loss and its weights and moments at the
#    end are those of the reference in one process on the same batches
#    (neuroctl train --groups 2 --outer-every 5: each group a trainer of
#    its own over microbatches i mod 2, nl_diloco_outer every 5 steps);
#    and again with 4 groups of one stage, an outer step after every step
#    (H = 1), a non-default outer lr and momentum and masked tokens (mlm:
#    each group's loss over its own masked positions). Both are
#    byte-identical today (the same sums in the same order: each group's
#    microbatches in order, the deltas in group order); the test allows
#    1e-6 relative (losses, weights) and 1e-4 (moments, whose rare rows
#    keep a last-bit difference longest) so that a change of sum order
#    alone does not fail it, while a wrong delta sign, a missing / R, an
#    anchor that is not the last sync's weights, a microbatch routed to
#    another group or a group's loss over other rows is off by 1e-2 or
#    more (nl_diloco_outer's own arithmetic: test_train);
#  - two runs on the same plan give byte-identical weights and losses;
#  - the weights are not those of every-step sync (one process on the same
#    batches stands for it: the replicas' every-step sum agrees with it to
#    5e-5, test_cluster_replicas), so the option does something;
#  - each replica's REDUCE traffic is the 2 outer steps' deltas only;
#  - --outer-lr reaches the stages (0: the weights end where they began);
#  - steps or a checkpoint interval that are not multiples of H, a resume,
#    --outer-every without replicas and an outer momentum of 1 are refused.
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20 # the plan groups the nodes in pairs of equal speed

small_config "$W/cfg.yaml" 32 4 48 64
cp "$CORPUS" "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
RUN=(--data "$W/data.txt" --steps 10 --batch 8 --seq 32 --microbatches 4 --lr 3e-3 --seed 1)
RUN7=(--data "$W/data.txt" --steps 7 "${RUN[@]:4}") # 7 steps: not a multiple of H

# every-step sync's weights: one process on the same batches
check "$N" train "${DEV[@]}" --model "$W/m.safetensors" "${RUN[@]}" --threads 1 \
  --log "$W/local.jsonl" --out "$W/local.safetensors" 2> "$W/local.err"
# DiLoCo's: the 2 replica groups in one process
check "$N" train "${DEV[@]}" --model "$W/m.safetensors" "${RUN[@]}" --threads 1 --groups 2 \
  --outer-every 5 --log "$W/ref.jsonl" --out "$W/ref.safetensors" 2> "$W/ref.err"
tail -1 "$W/ref.err"
# the reference's flags: refused where a cluster's DiLoCo is, by name
for bad in "--groups 2|go together" "--outer-every 5|go together" \
  "--groups 3 --outer-every 5|--microbatches 4: not a multiple of --groups 3" \
  "--groups 2 --outer-every 3|--steps 10: not a multiple of --outer-every 3"; do
  # shellcheck disable=SC2086
  out=$("$N" train --model "$W/m.safetensors" "${RUN[@]}" --out "$W/bad.safetensors" ${bad%|*} 2>&1)
  rc=$?
  echo "${bad%|*}: $(echo "$out" | tail -1)"
  check test $rc -eq 2
  check grep -q -- "${bad#*|}" <<< "$out"
done

cat > "$W/cmp.py" <<'PY'
import json, struct, sys
def tensors(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    out = {}
    for k, v in h.items():
        if k == "__metadata__" or k.startswith("optim."): continue
        s, e = v["data_offsets"]; out[k] = b[8 + n + s: 8 + n + e]
    return out
def floats(raw):
    return struct.unpack("<%df" % (len(raw) // 4), raw)
what, a, b = sys.argv[1], tensors(sys.argv[2]), tensors(sys.argv[3])
assert set(a) == set(b), set(a) ^ set(b)
if what == "same":      # every byte of every weight
    diff = [k for k in b if a[k] != b[k]]
    print("%d tensors, %d differ in a byte" % (len(b), len(diff)))
    assert not diff, diff[:5]
else:                   # differ: the weights as a whole differ by more than 1e-3 (relative)
    num = den = 0.0
    for k in b:
        for x, y in zip(floats(a[k]), floats(b[k])):
            num += (x - y) ** 2; den += y * y
    print("relative difference of the weights: %.3e" % (num / den) ** 0.5)
    assert (num / den) ** 0.5 > 1e-3
PY

up() {
  check "$N" cluster up "${DEV[@]}" --dir "$1" --nodes 4 --replicas 2 --outer-every 5 \
    --model "$W/m.safetensors" --memory 64M --threads 1 --node-timeout-ms 2000 --timeout 60
}

# ---- two runs on the same plan ----
C="$W/c1"
up "$C"
check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-every 5 --checkpoint-dir "$W/ck1" \
  --log "$W/r1.jsonl" --out "$W/r1.safetensors" 2> "$W/r1.err"
tail -2 "$W/r1.err"
check grep -q '"step":10,' "$W/r1.jsonl"
# the reference's losses, weights and moments
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" logs "$W/r1.jsonl" "$W/ref.jsonl" 1e-6
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" weights "$W/r1.safetensors" "$W/ref.safetensors" 1e-6 1e-4
# a shard per stage at the outer steps (replica 0's)
check test "$(ls "$W"/ck1/step-000005/stage-*.safetensors | wc -l)" -eq 2
# every replica of every stage took 2 outer steps, and sent only their
# deltas. Which lines are there when the job has ended: every replica's
# outer step at step 5 (each trained on after it), and at step 10 replica
# 0's (its shard is the checkpoint, taken after its outer step); the other
# replicas log theirs when their last REDUCE chunk comes, which may be
# after the client has returned.
check test "$(cat "$C"/node-*.log | grep -c 'step 5: outer step of 2 replica groups')" -eq 4
check test "$(cat "$C"/node-*.log | grep -c 'step 10: outer step of 2 replica groups; replica 0 ')" -eq 2
grep -h "outer step of 2 replica groups" "$C"/node-*.log | tail -2
$PY - "$C" "$W/m.safetensors" <<'PY'
import glob, json, re, struct, sys
b = open(sys.argv[2], "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
sent = {}  # step -> the bytes each replica had sent by its outer step there
for f in glob.glob(sys.argv[1] + "/node-*.log"):
    for step, x in re.findall(r"step (\d+): outer step .* has sent (\d+) bytes", open(f).read()):
        sent.setdefault(int(step), []).append(int(x))
# the deltas go round the ring about twice per outer step: 2 syncs x 2 x a stage's weights
params = sum(int(v["data_offsets"][1]) - int(v["data_offsets"][0]) for k, v in h.items()
             if k != "__metadata__")
print("REDUCE bytes each replica had sent by its outer steps:", sent, "weights:", params)
assert len(sent[5]) == 4 and max(sent[5]) <= 2 * params + 4096, sent
assert 2 <= len(sent[10]) <= 4 and max(sent[10]) <= 2 * 2 * params + 4096, sent
PY
check test $? -eq 0

# ---- refused: steps or checkpoints between outer steps, a resume ----
out=$("$N" train --cluster "$C" "${RUN7[@]}" --checkpoint-dir "$W/ck3" 2>&1); rc=$?
echo "$out" | tail -1
check test $rc -ne 0
check grep -q "not a multiple of --outer-every 5" <<< "$out"
out=$("$N" train --cluster "$C" "${RUN[@]}" --checkpoint-every 3 --checkpoint-dir "$W/ck3" 2>&1); rc=$?
echo "$out" | tail -1
check test $rc -ne 0
check grep -q "checkpoint-every 3: not a multiple" <<< "$out"
out=$("$N" train --cluster "$C" "${RUN[@]}" --resume "$W/ck1/step-000005" --checkpoint-dir "$W/ck3" 2>&1); rc=$?
echo "$out" | tail -1
check test $rc -ne 0
check grep -q "not with --outer-every" <<< "$out"
check "$N" cluster down --dir "$C"

C="$W/c2"
up "$C"
check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck2" --log "$W/r2.jsonl" \
  --out "$W/r2.safetensors" 2> "$W/r2.err"
check $PY "$W/cmp.py" same "$W/r2.safetensors" "$W/r1.safetensors"
check $PY "$W/cmp.py" differ "$W/r1.safetensors" "$W/local.safetensors"
check "$N" cluster down --dir "$C"

# ---- the outer step's lr reaches the stages: with --outer-lr 0 every outer
# step puts the weights back at the last sync's, here the initial ones ----
C="$W/c3"
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 4 --replicas 2 --outer-every 5 --outer-lr 0 \
  --model "$W/m.safetensors" --memory 64M --threads 1 --node-timeout-ms 2000 --timeout 60
check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck4" --log "$W/r3.jsonl" \
  --out "$W/r3.safetensors" 2> "$W/r3.err"
check grep -q '"step":10,' "$W/r3.jsonl"
check $PY "$W/cmp.py" same "$W/r3.safetensors" "$W/m.safetensors"
check "$N" cluster down --dir "$C"

# ---- 4 groups of one stage, H = 1, outer lr 0.5 and momentum 0.5, mlm:
# the reference again ----
small_config "$W/mlm.yaml" 32 4 48 64
sed -i 's/^vocab_size: 256/vocab_size: 264/; s/^vocab_chunk: 256/vocab_chunk: 264/' "$W/mlm.yaml"
check "$N" init --config "$W/mlm.yaml" --out "$W/mlm.safetensors" --seed 7
MLM=(--data "$W/data.txt" --steps 6 --batch 8 --seq 32 --microbatches 4 --lr 3e-3 --seed 1
     --objective mlm --eval-every 3 --eval-batches 2)
OUTER=(--outer-every 1 --outer-lr 0.5 --outer-momentum 0.5)
check "$N" train "${DEV[@]}" --model "$W/mlm.safetensors" "${MLM[@]}" --threads 1 --groups 4 \
  "${OUTER[@]}" --log "$W/ref4.jsonl" --out "$W/ref4.safetensors" 2> "$W/ref4.err"
C="$W/c5"
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 4 --replicas 4 "${OUTER[@]}" \
  --model "$W/mlm.safetensors" --memory 64M --threads 1 --node-timeout-ms 2000 --timeout 60
check "$N" train --cluster "$C" "${MLM[@]}" --checkpoint-dir "$W/ck5" --log "$W/r4.jsonl" \
  --out "$W/r4.safetensors" 2> "$W/r4.err"
# (steps 1 to 5: every replica's outer step; step 6, the last: replica 0's
# before the job's end, as above)
check test "$(cat "$C"/node-*.log | grep -c 'step [1-5]: outer step of 4 replica groups')" -eq 20
check test "$(cat "$C"/node-*.log | grep -c 'step 6: outer step of 4 replica groups; replica 0 ')" -eq 1
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" logs "$W/r4.jsonl" "$W/ref4.jsonl" 1e-6
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" weights "$W/r4.safetensors" "$W/ref4.safetensors" 1e-6 1e-4
check "$N" cluster down --dir "$C"

# ---- without replicas, or a momentum of 1: refused at the start ----
out=$("$COORD" --listen tcp://127.0.0.1:0 --state-dir "$W/st" --outer-every 5 --replicas 2 \
  --outer-momentum 1 2>&1); rc=$?
echo "$out" | tail -1
check test $rc -eq 2
check grep -q "outer-momentum" <<< "$out"
out=$("$COORD" --listen tcp://127.0.0.1:0 --state-dir "$W/st" --outer-every 5 --replicas 1 2>&1); rc=$?
echo "$out" | tail -1
check test $rc -eq 2
check grep -q "needs replica groups" <<< "$out"

echo "test_cluster_diloco: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
