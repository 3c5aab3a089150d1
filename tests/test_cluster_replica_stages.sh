#!/usr/bin/env bash
# Stages with different replica counts (DESIGN section 8; neurocoord
# --replicas R0,R1): 3 nodes as stage 0 on 2 replicas and stage 1 on one
# (then 1 + 2) train 20 steps, microbatch i on replica i mod R_s of each
# stage, so a replica of stage 0 sends to the one replica of stage 1 and
# takes its gradients back from it (and the other way round):
#  - every step's loss within 1e-6 (relative) of neuroctl train in one
#    process on the same checkpoint, seed, data and batches, and at the
#    end the weights within 5e-5, the AdamW moments within 5e-3;
#  - two runs on the same plan are byte-identical (every loss, every byte
#    of the exported weights and moments);
#  - a checkpoint holds one shard per stage (replica 0 writes it);
#  - on 4 nodes (one a standby) a replica of stage 0 killed at step ~7:
#    its survivor and stage 1 write the step under way, the job resumes by
#    itself from it, the standby in its place, and the run is
#    byte-identical;
#  - neuroctl status shows the counts per stage; a generation on the
#    cluster (replica 0 of each stage) gives one process's tokens;
#  - a job whose microbatches do not divide among a stage's replicas is
#    refused, and so is a list that is no list of counts.
. "$(dirname "$0")/cluster_lib.sh"
# every node reports the same throughput (neuronode's test hook)
export NL_TEST_GFLOPS=20

small_config "$W/cfg.yaml" 32 4 48 64
cp "$CORPUS" "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
RUN=(--data "$W/data.txt" --steps 20 --batch 8 --seq 32 --microbatches 4 --lr 3e-3 --seed 1
     --eval-every 10 --eval-batches 2)

# ---- the reference: one process ----
check "$N" train "${DEV[@]}" --model "$W/m.safetensors" "${RUN[@]}" --threads 1 --log "$W/local.jsonl" \
  --out "$W/local.safetensors" 2> "$W/local.err"


# up CLUSTER COUNTS [NODES [MODEL]]: NODES (3) nodes on the plan COUNTS
# (--replicas R0,R1) serving MODEL (m)
up() {
  check "$N" cluster up "${DEV[@]}" --dir "$1" --nodes "${3:-3}" --replicas "$2" \
    --model "$W/${4:-m}.safetensors" --memory 64M --threads 1 --node-timeout-ms 2000 --timeout 60
}

# ---- stage 0 on 2 replicas, stage 1 on 1 ----
C="$W/c21"
up "$C" 2,1
check grep -q "plan 1: stage 0 on node [0-9]* (replicas on [0-9]*)" "$C/coord.log"
check grep -q "the previous stage has 2 replicas, the next 2" "$C"/node-*.log
# inference runs on replica 0 of each stage: the ids of one process
check "$N" generate --cluster "$C" --prompt-tokens 72,101 --max-new 6 --temperature 0 > "$W/gen.c" 2>/dev/null
check "$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 72,101 --max-new 6 \
  --temperature 0 --threads 1 > "$W/gen.l" 2>/dev/null
check cmp -s "$W/gen.c" "$W/gen.l"
"$N" status --cluster "$C" > "$W/status.txt"
grep "^replicas" "$W/status.txt"
check grep -q "^replicas: 2,1 per stage .*a count per stage" "$W/status.txt"
check test "$(grep -c ' r[01]/2 ' "$W/status.txt")" -eq 2
check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-every 10 --checkpoint-dir "$W/ck1" \
  --log "$W/r1.jsonl" --out "$W/r1.safetensors" 2> "$W/r1.err"
tail -2 "$W/r1.err"
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" logs "$W/r1.jsonl" "$W/local.jsonl" 1e-6
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" weights "$W/r1.safetensors" "$W/local.safetensors" 5e-5 5e-3
check test "$(ls "$W"/ck1/step-000010/stage-*.safetensors | wc -l)" -eq 2
# microbatches that do not divide between stage 0's replicas: refused
out=$("$N" train --cluster "$C" --data "$W/data.txt" --steps 2 --batch 6 --seq 32 --microbatches 3 \
  --checkpoint-dir "$W/ck3" 2>&1); rc=$?
echo "$out" | tail -1
check test $rc -ne 0
check grep -q "2 replicas of stage 0: .*multiple" <<< "$out"
check "$N" cluster down --dir "$C"

# ---- the same plan again: byte-identical ----
C="$W/c21b"
up "$C" 2,1
check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck2" --log "$W/r2.jsonl" \
  --out "$W/r2.safetensors" 2> "$W/r2.err"
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" logs "$W/r2.jsonl" "$W/r1.jsonl" 0
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" weights "$W/r2.safetensors" "$W/r1.safetensors" 0
check "$N" cluster down --dir "$C"

# ---- a replica of stage 0 killed at step ~7: the run goes on, unchanged ----
# The survivors write the step under way (cluster_lib.sh's
# train_kill_replica), re-plan 2,1 (the standby in the dead node's place)
# and reload it. A model of 2 layers has one split into 2
# stages, so the new plan is the old one whatever speeds the coordinator
# observed meanwhile (a layer moved between stages of 2 replicas and 1
# would add its gradients in another order)
small_config "$W/cfg2.yaml" 32 2 48 64
check "$N" init --config "$W/cfg2.yaml" --out "$W/m2.safetensors" --seed 7
C="$W/c21r"
up "$C" 2,1 4 m2
check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck6" --log "$W/ref2.jsonl" \
  --out "$W/ref2.safetensors" 2> "$W/ref2.err"
check "$N" cluster down --dir "$C"
C="$W/c21k"
# (each training message 10 ms more: the job is under way when the kill lands)
NL_TEST_SLOW_MS=10 up "$C" 2,1 4 m2
train_kill_replica "$C" "$(replica_node "$C" 0 1)" "$W/ref2" "${RUN[@]}"
check "$N" cluster down --dir "$C"

# ---- stage 0 on 1, stage 1 on 2 ----
C="$W/c12"
up "$C" 1,2
check "$N" generate --cluster "$C" --prompt-tokens 72,101 --max-new 6 --temperature 0 > "$W/gen.c12" 2>/dev/null
check cmp -s "$W/gen.c12" "$W/gen.l"
check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck4" --log "$W/r3.jsonl" \
  --out "$W/r3.safetensors" 2> "$W/r3.err"
tail -1 "$W/r3.err"
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" logs "$W/r3.jsonl" "$W/local.jsonl" 1e-6
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" weights "$W/r3.safetensors" "$W/local.safetensors" 5e-5 5e-3
check "$N" cluster down --dir "$C"

# ---- counts that are no counts: refused by neurocoord ----
for bad in 2,0 2,,1 "2, 1" 2,17 1,x 2, ,2 -1,2; do
  out=$("$COORD" --replicas "$bad" --listen tcp://127.0.0.1:0 --state-dir "$W/sd" 2>&1); rc=$?
  check test $rc -eq 2
  check grep -q "is not auto, a whole number" <<< "$out"
done

echo "test_cluster_replica_stages: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
