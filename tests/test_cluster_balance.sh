#!/usr/bin/env bash
# Identical nodes get equal work (issue 30 item 0): the same job on two
# identical 1-thread nodes, five times, each on a fresh cluster, with the
# nodes' real throughput probes (no NL_TEST_GFLOPS) on whatever else this
# machine is running meanwhile: the plan the job trains on after its early
# re-balance is [0, 4) + [4, 8) every time, and every run's weights are
# byte-identical to the others' and equal to one node's.
#   the probe: the median of 5 rounds timed by the node's CPU time over its
#     threads (other processes on the cores do not count);
#   the early re-balance (neurocoord --rebalance-after, default 3): after
#     3 steps and 3 heartbeats of each stage (--heartbeat-ms 100 here), the
#     stages' measured busy times decide; a split off by more than
#     --replan-margin in two judgements in a row (one window can fall on a
#     burst of other work) is corrected through a checkpoint at that step.
. "$(dirname "$0")/cluster_lib.sh"
unset NL_TEST_GFLOPS

small_config "$W/cfg.yaml" 64 8 128 64
cp "$CORPUS" "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
RUN=(--data "$W/data.txt" --steps 16 --batch 16 --seq 64 --microbatches 4 --lr 3e-3 --seed 1)
UP=(cluster up "${DEV[@]}" --model "$W/m.safetensors" --memory 96M --threads 1 --heartbeat-ms 100
    --node-timeout-ms 3000 --timeout 60)

# ---- the reference: one node ----
check "$N" "${UP[@]}" --nodes 1 --dir "$W/c1"
check "$N" train --cluster "$W/c1" "${RUN[@]}" --checkpoint-dir "$W/ck1" --out "$W/ref.safetensors" \
  2> /dev/null
"$N" cluster down --dir "$W/c1" > /dev/null

# the split of the last plan in a coordinator's log: "0-4 4-8"
last_plan() {
  $PY - "$1" <<'PY'
import re, sys
groups = []
for what, s, a, b in re.findall(r"plan (\S+): stage (\d+) on node \d+: layers \[(\d+), (\d+)\)",
                                open(sys.argv[1]).read()):
    if s == "0":
        groups.append([])
    groups[-1].append("%s-%s" % (a, b))
print(" ".join(groups[-1]) if groups else "none")
PY
}

even=0
for run in 1 2 3 4 5; do
  C="$W/c2-$run"
  check "$N" "${UP[@]}" --nodes 2 --dir "$C"
  check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck2-$run" \
    --out "$W/run-$run.safetensors" 2> "$W/train-$run.err"
  first=$(grep -o "GFLOP/s (median of [^)]*)" "$C"/node-*.log | tr '\n' ' ')
  plan=$(last_plan "$C/coord.log")
  moved=$(grep -c "measured speeds call for another split" "$C/coord.log")
  echo "run $run: plan $plan (early re-balance: $moved); probes: $first"
  [ "$plan" = "0-4 4-8" ] && even=$((even + 1))
  # even, or one layer off it: on a machine whose load swings within the
  # job the early re-balance can act on measured times that differ by more
  # than --replan-margin (seen in a CI run: one run of five ended 0-5 5-8
  # after three re-plans); never further off than that
  case "$plan" in "0-4 4-8" | "0-3 3-8" | "0-5 5-8") check true ;; *) check test "$plan" = "0-4 4-8" ;; esac
  check cmp "$W/run-$run.safetensors" "$W/run-1.safetensors"
  "$N" cluster down --dir "$C" > /dev/null
done
echo "the even split in $even of 5 runs"
check test "$even" -ge 3

# ---- a probe that is wrong: the early re-balance corrects it ----
# one node from cluster up, and a second that joins reporting a third of
# its throughput (NL_TEST_GFLOPS): the plan at rest gives it fewer layers;
# the job's measured stage times move them back after a few steps, through
# a checkpoint at that step, and the weights stay bit-identical
C="$W/c3"
check "$N" "${UP[@]}" --nodes 1 --dir "$C"
g=$(grep -o "gemm [0-9]*^3 [0-9.]* GFLOP/s" "$C"/node-1.log | awk '{print $3}')
"$N" keygen --out "$W/liar" > /dev/null
echo "$(cat "$W/liar.pub")  # liar" >> "$C/coord/authorized_keys"
check reload_keys "$C"
NL_TEST_GFLOPS=$($PY -c "print(round($g / 3, 1))") "$NODE" join "${DEV[@]}" \
  "$(cat "$C/coord/endpoint")" --key "$W/liar.key" --coordinator-key "$C/coord/coordinator.pub" \
  --memory 96M --threads 1 --name liar --checkpoint-root "$W" > "$W/liar.log" 2>&1 &
liar=$!
test_cleanup() { kill "$liar" 2>/dev/null; }
for i in $(seq 1 600); do
  [ "$(last_plan "$C/coord.log")" != "0-8" ] && [ "$(last_plan "$C/coord.log")" != "none" ] &&
    "$N" status --cluster "$C" 2>/dev/null | grep -q "^ready\|ready:" && break
  sleep 0.1
done
before=$(last_plan "$C/coord.log")
check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck3" --out "$W/run-liar.safetensors" \
  2> "$W/train-liar.err"
after=$(last_plan "$C/coord.log")
echo "a node that under-reports: plan $before, after the early re-balance $after"
grep "measured speeds\|re-plan at the checkpoint\|observed:" "$C/coord.log"
check test "$before" != "0-4 4-8"
# corrected to even, or within one layer of it (a CI run under load went
# 0-6 6-8 -> 0-3 3-8 in one re-balance, the job too short for a second)
case "$after" in "0-4 4-8" | "0-3 3-8" | "0-5 5-8") check test "$after" != "$before" ;;
  *) check test "$after" = "0-4 4-8" ;; esac
check grep -q "measured speeds call for another split after step" "$C/coord.log"
check cmp "$W/run-liar.safetensors" "$W/run-1.safetensors"
check $PY "$NL_SOURCE_DIR/tests/same_tensors.py" "$W/run-1.safetensors" "$W/ref.safetensors"

echo "test_cluster_balance: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
