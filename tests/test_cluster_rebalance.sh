#!/usr/bin/env bash
# Plans from what was measured (issue 22 item 5): two nodes report the same
# throughput, but one is slower than it said (NL_TEST_SLOW_X: each training
# message takes 4 times its work there; a fixed 15 ms more, NL_TEST_SLOW_MS,
# was a quarter of a message's work in the sanitizer build, less than what
# the cost model misses there, and the judgement rightly kept the split). The coordinator sees it in the stages'
# busy fractions (heartbeats) and, at the next checkpoint (the early
# re-balance's, after a few steps, or the job's own), re-plans with the
# observed figures beyond --replan-margin (two judgements in a row, each
# over 3 heartbeats: --heartbeat-ms 200 here, so that they fit in the job on
# a fast machine too, where its 60 steps last a few seconds; at the default
# 1000 ms the job could end before the second): the slow node loses layers (or
# all of them: a standby), the job goes on from that checkpoint, and its
# final weights are bit-identical to the same job on one node.
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20
extra=0
test_cleanup() { [ "$extra" -gt 0 ] && kill "$extra" 2>/dev/null; }

small_config "$W/cfg.yaml" 32 6 48 64
cp "$CORPUS" "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
RUN=(--data "$W/data.txt" --steps 60 --batch 16 --seq 64 --microbatches 2 --lr 3e-3 --seed 1
     --checkpoint-every 30)
UP=(cluster up "${DEV[@]}" --model "$W/m.safetensors" --memory 64M --threads 1
    --heartbeat-ms 200 --node-timeout-ms 3000 --timeout 60)

# ---- the reference: the same job on one node ----
check "$N" "${UP[@]}" --nodes 1 --dir "$W/c1"
check "$N" train --cluster "$W/c1" "${RUN[@]}" --checkpoint-dir "$W/ck1" --out "$W/ref.safetensors" \
  2> /dev/null
"$N" cluster down --dir "$W/c1" >/dev/null

# ---- one node, then a slow one joins (at rest: two stages, equal shares) ----
C="$W/c2"
check "$N" "${UP[@]}" --nodes 1 --dir "$C"
"$N" keygen --out "$W/slow" >/dev/null
echo "$(cat "$W/slow.pub")  # slow" >> "$C/coord/authorized_keys"
check reload_keys "$C"
NL_TEST_SLOW_X=4 "$NODE" join "${DEV[@]}" "$(cat "$C/coord/endpoint")" --key "$W/slow.key" \
  --coordinator-key "$C/coord/coordinator.pub" --memory 64M --threads 1 --name slow \
  --checkpoint-root "$W" > "$W/slow.log" 2>&1 &
extra=$!
for i in $(seq 1 600); do
  [ "$("$N" status --cluster "$C" 2>/dev/null | grep -c serving)" -eq 2 ] && break
  sleep 0.1
done
check test "$("$N" status --cluster "$C" 2>/dev/null | grep -c serving)" -eq 2
"$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck2" --out "$W/slow.safetensors" \
  2> "$W/train.err" &
tpid=$!
# the status while a plan made for training serves the job (checked
# below): read during the job, since once it ends the coordinator may
# re-plan at rest for serving from the speeds it measured
got=0
while kill -0 "$tpid" 2>/dev/null; do
  "$N" status --cluster "$C" --json > "$W/during.json" 2>/dev/null
  if grep -q '"train_bottleneck_s"' "$W/during.json" &&
    "$N" status --cluster "$C" > "$W/during.txt" 2>/dev/null &&
    grep -q "^this plan was made for training" "$W/during.txt"; then
    got=1
    break
  fi
  sleep 0.05
done
wait "$tpid"
check test $? -eq 0
check test "$got" -eq 1
tr '\r' '\n' < "$W/train.err" | grep -v "^step" | tail -6
grep "observed:\|re-plan at the checkpoint\|plan old\|plan new" "$C/coord.log"
check grep -q "observed: node 2 (stage [01]) busy" "$C/coord.log"
check grep -q "re-plan at the checkpoint: bottleneck" "$C/coord.log"
# the client says why: measured speeds, not a join (issue 34, item 5)
check grep -q "^re-planning at the checkpoint of step [0-9]* (.*the stages' measured speeds differ" \
  "$W/train.err"
check test "$(grep -c "parameters on" "$W/train.err")" -eq 1 # the header once
check test "$(grep -c "nodes joined" "$W/train.err")" -eq 0
layers() { # layers of node 2 in the plan logged as $1 (old or new) at the first re-plan; 0: standby
  # (the first: later ones judge again on the new plan, and on a loaded
  # machine its measured times may move a layer back)
  $PY - "$C/coord.log" "$1" <<'PY'
import re, sys
log = open(sys.argv[1]).read()
mark = "re-plan at the checkpoint: bottleneck"
at = log.find(mark)
if at < 0:
    sys.exit(0)
end = log.find(mark, at + 1)
seg = log[at:end] if end > 0 else log[at:]
n = 0
for a, b in re.findall(r"plan %s: stage \d+ on node 2: layers \[(\d+), (\d+)\)" % sys.argv[2], seg):
    n += int(b) - int(a)
print(n)
PY
}
old=$(layers old)
new=$(layers new)
echo "the slow node held ${old:-?} layers, then ${new:-?}"
check test -n "$old"
check test -n "$new"
check test "${new:-9}" -lt "${old:-0}"
check $PY "$NL_SOURCE_DIR/tests/same_tensors.py" "$W/slow.safetensors" "$W/ref.safetensors"
# the plan made for training (read above, during the job): status reports its
# figure per request (what serving costs) and the training microbatch's
# apart (forward and backward of the job's 512 rows: about 3x a request of
# --plan-rows 512), never the one as the other (issue 34, item 5)
check $PY - "$W/during.json" <<'EOF'
import json, sys
st = json.load(open(sys.argv[1]))
b, tb = st["bottleneck_s"], st.get("train_bottleneck_s")
pred = max(n["predicted_s"] for n in st["nodes"] if "predicted_s" in n)
print("per request %.2f ms, per training microbatch %s ms" % (b * 1e3, tb and round(tb * 1e3, 2)))
sys.exit(0 if tb and tb > 2 * b and abs(pred - b) < 1e-9 else 1)
EOF
check grep -q "^this plan was made for training: [0-9.]* ms per training microbatch" \
  "$W/during.txt"

echo "test_cluster_rebalance: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
