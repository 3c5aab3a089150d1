#!/usr/bin/env bash
# A pipeline stage replicated across nodes (DESIGN section 8, "Replicas";
# neurocoord --replicas): 4 nodes as 2 stages x 2 replicas train 20 steps
#  - every step's loss within 1e-6 (relative) of neuroctl train in one
#    process on the same checkpoint, seed, data and batches, and at the
#    end the weights within 5e-5, the AdamW moments within 5e-3 (the
#    data is the project's own documents, which change);
#  - two runs on the same plan are byte-identical (every loss, every byte
#    of the exported weights and moments);
#  - a checkpoint holds one shard per stage (replica 0 writes it), which
#    neuroctl export joins;
#  - a replica's node killed at step ~7: the survivors write the step
#    under way (the job has no checkpoint since step 0), the job resumes
#    by itself from that step on the nodes left, and the run is
#    byte-identical;
#  - neuroctl status shows every node's replica; a generation on the
#    cluster (replica 0 of each stage) gives one process's tokens;
#  - a fine-tuning job on the replicas (its adapters' gradients added up
#    round each stage's ring) equals neuroctl finetune in one process
#    within 1e-5: every loss, every adapter tensor;
#  - a job whose microbatches do not divide among the replicas is refused.
. "$(dirname "$0")/cluster_lib.sh"
# every node reports the same throughput (neuronode's test hook): the
# plan groups the nodes in pairs of equal speed
export NL_TEST_GFLOPS=20

small_config "$W/cfg.yaml" 32 4 48 64
cp "$CORPUS" "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
RUN=(--data "$W/data.txt" --steps 20 --batch 8 --seq 32 --microbatches 4 --lr 3e-3 --seed 1
     --eval-every 10 --eval-batches 2)

# ---- the reference: one process ----
check "$N" train "${DEV[@]}" --model "$W/m.safetensors" "${RUN[@]}" --threads 1 --log "$W/local.jsonl" \
  --out "$W/local.safetensors" 2> "$W/local.err"


# ---- 2 stages x 2 replicas on 4 nodes ----
C="$W/c4"
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 4 --replicas 2 --model "$W/m.safetensors" \
  --memory 64M --threads 1 --node-timeout-ms 2000 --timeout 60
check grep -q "replicas on" "$C/coord.log"
# inference runs on replica 0 of each stage: the ids of one process
check "$N" generate --cluster "$C" --prompt-tokens 72,101 --max-new 6 --temperature 0 > "$W/gen.c" 2>/dev/null
check "$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 72,101 --max-new 6 \
  --temperature 0 --threads 1 > "$W/gen.l" 2>/dev/null
check cmp -s "$W/gen.c" "$W/gen.l"
# neuroctl status shows each node's replica and why the stages have them
"$N" status --cluster "$C" > "$W/status.txt"
cat "$W/status.txt"
check test "$(grep -c ' r[01]/2 ' "$W/status.txt")" -eq 4
check grep -q "^replicas: 2 per stage" "$W/status.txt"
# fine-tuning on the replicas: each runs its share of the microbatches and
# the adapters' gradients are added up round the stage's ring, as one
# process adds them (the base is the same: nothing has trained it yet)
FT=(--data "$W/data.txt" --steps 6 --batch 8 --seq 32 --microbatches 4 --lr 3e-3 --seed 2
    --lora-rank 4 --lora-alpha 8 --lora-targets wq,wo,w_gate,w_down --eval-every 3 --eval-batches 2)
check "$N" finetune "${DEV[@]}" --model "$W/m.safetensors" "${FT[@]}" --threads 1 \
  --log "$W/ft_local.jsonl" --out "$W/ft_local.safetensors" 2> "$W/ft_local.err"
check "$N" finetune --cluster "$C" "${FT[@]}" --checkpoint-dir "$W/ckft" --log "$W/ft_r.jsonl" \
  --out "$W/ft_r.safetensors" 2> "$W/ft_r.err"
tail -2 "$W/ft_r.err"
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" logs "$W/ft_r.jsonl" "$W/ft_local.jsonl" 1e-5
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" weights "$W/ft_r.safetensors" "$W/ft_local.safetensors" 1e-5
# replica 1 of both stages ran its share (the losses above need the sums)
check test "$(cat "$C"/node-*.log | grep -c "replica 1 of the stage's 2: microbatches 1")" -eq 2
check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-every 10 --checkpoint-dir "$W/ck1" \
  --log "$W/r1.jsonl" --out "$W/r1.safetensors" 2> "$W/r1.err"
tail -3 "$W/r1.err"
check grep -q "on 2 pipeline stages" "$W/r1.err"
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" logs "$W/r1.jsonl" "$W/local.jsonl" 1e-6
# the moments of tiny gradients (the embedding's rare rows) keep more of
# the sum order's last-bit differences than the weights do
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" weights "$W/r1.safetensors" "$W/local.safetensors" 5e-5 5e-3
# one shard per stage: replica 0 writes it
check test "$(ls "$W"/ck1/step-000010/stage-*.safetensors | wc -l)" -eq 2
check "$N" export --manifest "$W/ck1/step-000020" --out "$W/export.safetensors"
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" weights "$W/export.safetensors" "$W/r1.safetensors" 0

# ---- the same plan again: byte-identical ----
check "$N" cluster down --dir "$C"
C="$W/c4b"
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 4 --replicas 2 --model "$W/m.safetensors" \
  --memory 64M --threads 1 --node-timeout-ms 2000 --timeout 60
check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck2" --log "$W/r2.jsonl" \
  --out "$W/r2.safetensors" 2> "$W/r2.err"
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" logs "$W/r2.jsonl" "$W/r1.jsonl" 0
check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" weights "$W/r2.safetensors" "$W/r1.safetensors" 0

# ---- replica 0 of stage 1 killed at step ~7: the run goes on, unchanged ----
# Each stage still has a live replica (stage 1's replica 1 in the place
# of its replica 0, which wrote its shards so far), which writes the steps done at once
# (step-N.resume1: the job writes no checkpoint of its own before step
# 20); the survivors re-plan (3 nodes: one stage on 2 replicas, the third
# a standby), reload it and go on from the step under way: each replica
# still adds its microbatches in order and the replicas in replica order,
# so the run is byte-identical to the undisturbed one.
check "$N" cluster down --dir "$C"
C="$W/c4k"
# (each training message takes 10 ms more, NL_TEST_SLOW_MS, so that the
# job is still under way when the kill lands, however busy the machine)
check env NL_TEST_SLOW_MS=10 "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 4 --replicas 2 --model "$W/m.safetensors" \
  --memory 64M --threads 1 --node-timeout-ms 2000 --timeout 60
train_kill_replica "$C" "$(replica_node "$C" 1 0)" "$W/r1" "${RUN[@]}"

# ---- --replicas auto: the cost model picks S x R; status says so ----
check "$N" cluster down --dir "$C"
C="$W/c4a"
# the replicas' all-reduce reports the 1 GB/s assumed before any measurement:
# the plan (and the refusal below) does not hang on how fast a busy machine
# adds up (test_cluster_replica_link covers a measured slow link)
export NL_TEST_LINK_BYTES_S=1e9
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 4 --replicas auto --plan-microbatches 4 \
  --model "$W/m.safetensors" --memory 64M --threads 1 --node-timeout-ms 2000 --timeout 60
"$N" status --cluster "$C" > "$W/status-auto.txt"
grep "^replicas" "$W/status-auto.txt"
check grep -q "^replicas: [124] per stage .*--replicas auto" "$W/status-auto.txt"
check "$N" train --cluster "$C" --data "$W/data.txt" --steps 2 --batch 8 --seq 32 --microbatches 4 \
  --checkpoint-dir "$W/ck5" --log "$W/auto.jsonl" 2> "$W/auto.err"
check grep -q '"step":2,' "$W/auto.jsonl"

# ---- microbatches that do not divide among the replicas: refused ----
out=$("$N" train --cluster "$C" --data "$W/data.txt" --steps 2 --batch 6 --seq 32 --microbatches 3 \
  --checkpoint-dir "$W/ck3" 2>&1); rc=$?
echo "$out" | tail -1
check test $rc -ne 0
check grep -q "multiple" <<< "$out"

check "$N" cluster down --dir "$C"
echo "test_cluster_replicas: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
