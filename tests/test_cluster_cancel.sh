#!/usr/bin/env bash
# Ctrl-C of `neuroctl train --cluster` keeps the steps done, as local
# training does: on a 2-node cluster a 40-step job (checkpoints every 20)
# is interrupted at step ~7. The client exits 130, the coordinator lets
# the step under way end, writes a checkpoint of it, and the job ends as
# cancelled naming the manifest; the manifest verifies, and `--resume` of
# it to step 40 ends bit-identical to an undisturbed 40-step run. A second
# Ctrl-C leaves at once, and the coordinator still writes the checkpoint;
# a Ctrl-C while a checkpoint is written keeps that one.
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20

small_config "$W/cfg.yaml" 32 2 48 64
cp "$CORPUS" "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
RUN=(--data "$W/data.txt" --steps 40 --batch 16 --seq 64 --microbatches 2 --lr 3e-3 --seed 1
     --checkpoint-every 20)
UP=(cluster up "${DEV[@]}" --model "$W/m.safetensors" --memory 64M --threads 1 --timeout 60)


# ---- the interrupted run: Ctrl-C at step ~7 ----
C="$W/c1"
check "$N" "${UP[@]}" --nodes 2 --dir "$C"
"$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck1" --log "$W/cut.jsonl" \
  --out "$W/never.safetensors" 2> "$W/cut.err" &
job=$!
wait_step "$W/cut.jsonl" 7 3000 0.02
# a second client given the running one's --out or --log is refused, naming its pid
for f in "--out $W/never.safetensors" "--log $W/cut.jsonl"; do
  # shellcheck disable=SC2086 # $f is a flag and its value
  out=$("$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck-other" $f 2>&1)
  check test $? -eq 1
  check grep -qF -- "$f: another run (pid $job) is writing there" <<< "$out"
done
kill -INT $job
wait $job
rc=$?
tr '\r' '\n' < "$W/cut.err" | grep -v "^step" | tail -5
check test $rc -eq 130
# the step it stopped at: at least 7, before the first checkpoint
k=$(sed -n 's/^interrupted after step \([0-9]*\) of 40: kept .*$/\1/p' "$W/cut.err")
echo "stopped at step ${k:-?}"
check test -n "$k"
k=${k:-0}
# (a loaded machine can take the run past its step-20 checkpoint while the
# two refused clients start: any step before the end will do)
check test "$k" -ge 7 -a "$k" -lt 40
M=$(printf '%s/ck1/step-%06d/manifest.json' "$W" "$k")
check grep -q "stopping after step [0-9]*: writing a checkpoint (Ctrl-C again to leave" "$W/cut.err"
check grep -q "interrupted after step $k of 40: kept $M (continue with --resume $M)" "$W/cut.err"
# a Ctrl-C that kept its steps reports no error (a poll's time-out was
# printed as "no answer from the coordinator in time")
check grep -q "^interrupted: cancelling job" "$W/cut.err"
check test -z "$(grep "neuroctl train:\|rtrain_" "$W/cut.err")"
check grep -q "cancelled at step $k; kept $M" "$C/coord.log"
# the client joins no --out on Ctrl-C (local training does not either)
check test ! -e "$W/never.safetensors"
# and no checkpoint after the one the Ctrl-C wrote
check test "$(ls "$W/ck1" | grep '^step-' | sort | tail -1)" = "$(printf 'step-%06d' "$k")"
check "$N" export --manifest "$M" --out "$W/cut.safetensors"
# ---- and resumed to step 40 on the same cluster ----
check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck1" --resume "$M" \
  --out "$W/resumed.safetensors" 2> "$W/resumed.err"
check grep -q "resuming at step $k" "$W/resumed.err"
"$N" cluster down --dir "$C" >/dev/null

# ---- the undisturbed run ----
C="$W/c2"
check "$N" "${UP[@]}" --nodes 2 --dir "$C"
check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck2" --out "$W/ref.safetensors" \
  2> "$W/ref.err"
"$N" cluster down --dir "$C" >/dev/null
check $PY "$NL_SOURCE_DIR/tests/same_tensors.py" "$W/resumed.safetensors" "$W/ref.safetensors"

# ---- a second Ctrl-C leaves at once; the coordinator still keeps the steps
# (its manifests are held 1.5 s by a test hook, so the client leaves first) ----
C="$W/c3"
check env NL_TEST_MANIFEST_DELAY_MS=1500 "$N" "${UP[@]}" --nodes 2 --dir "$C"
"$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck3" --log "$W/twice.jsonl" \
  2> "$W/twice.err" &
job=$!
wait_step "$W/twice.jsonl" 3 3000 0.02
kill -INT $job
for i in $(seq 1 6000); do grep -q "cancelling job" "$W/twice.err" && break; sleep 0.01; done
kill -INT $job
wait $job
check test $? -eq 130
check grep -q "^neuroctl train: interrupted again: left job" "$W/twice.err"
check test -z "$(ls "$W"/ck3/step-*/manifest.json 2>/dev/null)"
for i in $(seq 1 1200); do grep -q "cancelled at step [0-9]*; kept" "$C/coord.log" && break; sleep 0.05; done
k2=$(sed -n 's/^.*cancelled at step \([0-9]*\); kept .*$/\1/p' "$C/coord.log" | tail -1)
echo "left at once; the coordinator kept step ${k2:-?}"
check test -n "$k2"
check "$N" export --manifest "$(printf '%s/ck3/step-%06d' "$W" "${k2:-0}")" \
  --out "$W/twice.safetensors"
# ---- Ctrl-C while the checkpoint of step 20 is being written (the soak's
# case): that checkpoint is finished and kept, and no other is written ----
"$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck4" 2> "$W/mid.err" &
job=$!
for i in $(seq 1 3000); do
  grep -q "checkpoint of step 20: every shard is in; writing $W/ck4" "$C/coord.log" && break
  sleep 0.02
done
kill -INT $job
wait $job
check test $? -eq 130
tr '\r' '\n' < "$W/mid.err" | grep -v "^step" | tail -2
check grep -q "stopping after step 20: writing a checkpoint" "$W/mid.err"
check grep -q "interrupted after step 20 of 40: kept $W/ck4/step-000020/manifest.json" "$W/mid.err"
check test -z "$(grep "neuroctl train:\|rtrain_" "$W/mid.err")"
check test "$(ls -d "$W"/ck4/step-* | wc -l)" -eq 1
"$N" cluster down --dir "$C" >/dev/null

# ---- `cluster down` during a job: it stops as a cancelled one does (the
# step under way kept in a checkpoint, its client told and gone), and the
# next `cluster up` there does not bring it back ----
C="$W/c5"
check "$N" "${UP[@]}" --nodes 2 --dir "$C"
"$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck5" --log "$W/down.jsonl" \
  --timeout 120 2> "$W/down.err" &
job=$!
wait_step "$W/down.jsonl" 5 3000 0.02
t0=$(date +%s)
check "$N" cluster down --dir "$C"
wait $job
rc=$?
echo "the client ended (rc $rc) $(($(date +%s) - t0)) s after cluster down"
tr '\r' '\n' < "$W/down.err" | grep -v "^step" | tail -2
check test "$rc" -eq 130
check grep -q "the cluster is going down: train job 1 stops after the step under way" "$C/coord.log"
check test -z "$(grep "did not stop within" "$C/coord.log")"
check grep -q "interrupted after step [0-9]* of 40: kept $W/ck5/step-0000[0-9]*/manifest.json" "$W/down.err"
check test "$(ls "$W"/ck5/step-*/manifest.json | wc -l)" -eq 1
check grep -q '"train":null' "$C/coord/journal.json"
check "$N" "${UP[@]}" --nodes 2 --dir "$C"
check test "$("$N" jobs --cluster "$C" 2>&1 | grep -c "train")" -eq 0
"$N" cluster down --dir "$C" >/dev/null

echo "test_cluster_cancel: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
