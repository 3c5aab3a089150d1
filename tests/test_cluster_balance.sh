#!/usr/bin/env bash
# Identical nodes get equal work (issue 30 item 0): the same job on two
# identical 1-thread nodes, five times or more (twice or more in the
# sanitizers' Debug build: MIN_RUNS), each on a fresh cluster, with the
# nodes' real throughput probes (no NL_TEST_GFLOPS) on whatever else this
# machine is running meanwhile: where the two probes agree within 15%, the
# plan is [0, 4) + [4, 8) (every such run; one at least, of up to 12 made
# to find three, one in the Debug build: on a loaded 2-vCPU machine most
# runs' probes differ by more, as in two CI runs here, 2 and 1 of 12); the plan the job ends on,
# after its early re-balance, and the one at rest after it are within a
# layer of that; and every run's weights are byte-identical to the others'
# and equal to one node's. (The two vCPUs of a shared machine can run 40%
# apart for seconds on end; the probes and the stages' measured times then
# say so, and what follows from them may move a layer.) In the Debug build
# of the sanitizer run, two layers: the planner's cost model counts FLOPs,
# and there the project's own kernels (norms, softmax and cross-entropy over
# the vocabulary, attention) run unoptimised beside the BLAS GEMMs, so the
# stage with the head measures up to twice its planned time and whichever
# node holds it is judged that much slower (a CI run: 77 against 35 GFLOP/s
# for identical nodes), and a plan two layers off even is then the right one.
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

# the split of the last plan in a coordinator's log: "0-4 4-8"; with
# "first", of its first; with "job", of the last before training job 1
# ended; with "rebalance", of the first re-balance's new plan. With a node
# id as $3: the layers that node holds in that plan instead (0: none).
last_plan() {
  $PY - "$1" "${2:-last}" "${3:-}" <<'PY'
import re, sys
groups, mode, node = [], sys.argv[2], sys.argv[3]
replanned = False
for line in open(sys.argv[1]):
    if mode == "job" and "train job 1: done at step" in line:
        break
    if "re-plan at the checkpoint: bottleneck" in line:
        replanned = True
    m = re.search(r"plan (\S+): stage (\d+) on node (\d+): layers \[(\d+), (\d+)\)", line)
    if m and (mode != "rebalance" or (replanned and m.group(1) == "new")):
        if m.group(2) == "0":
            groups.append([])
        groups[-1].append((m.group(3), int(m.group(4)), int(m.group(5))))
    if mode == "rebalance" and groups and m is None and replanned:
        break
pick = groups[0] if mode in ("first", "rebalance") and groups else groups[-1] if groups else None
if node:
    print(sum(b - a for n, a, b in pick if n == node) if pick else 0)
else:
    print(" ".join("%d-%d" % (a, b) for n, a, b in pick) if pick else "none")
PY
}
# within NEAR layers of [0, 4) + [4, 8): one in an optimised build, two in
# the Debug build (above)
# the runs: at least MIN_RUNS, and until MIN_EVEN of them had probes within
# 15% of each other (below), MAX_RUNS at most. The Debug build's runs repeat
# the same code under the sanitizers, whose instrumented probes (3 to 6
# GFLOP/s) disagree by more than 15% in most runs (a run here: 3 of 10 within
# it): two runs there, until one is even; how often plans are even is the
# optimised build's to judge.
NEAR=1 MIN_RUNS=5 MIN_EVEN=3 MAX_RUNS=12
if grep -q "^CMAKE_BUILD_TYPE:STRING=Debug$" "$NL_BUILD_DIR/CMakeCache.txt" 2>/dev/null; then
  NEAR=2 MIN_RUNS=2 MIN_EVEN=1
fi
near_even() { # $1: a split as last_plan prints it
  case "$1" in *" "*" "* | none | 0-8) return 1 ;; esac
  local b=${1%% *}
  b=${b#0-}
  [ "$b" -ge $((4 - NEAR)) ] && [ "$b" -le $((4 + NEAR)) ]
}

# the runs (MIN_RUNS to MAX_RUNS, above): the two vCPUs of a shared
# machine can run 40% apart for seconds on end, and their CPU-time probes
# then say so
even=0
for run in $(seq 1 "$MAX_RUNS"); do
  C="$W/c2-$run"
  check "$N" "${UP[@]}" --nodes 2 --dir "$C"
  check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck2-$run" \
    --out "$W/run-$run.safetensors" 2> "$W/train-$run.err"
  probes=$(cat "$C"/node-*.log | sed -n 's/.*gemm [0-9]*^3 \([0-9.]*\) GFLOP\/s (median.*/\1/p' | tr '\n' ' ')
  first=$(last_plan "$C/coord.log" first)
  job=$(last_plan "$C/coord.log" job)
  plan=$(last_plan "$C/coord.log")
  moved=$(grep -c "measured speeds call for another split" "$C/coord.log")
  echo "run $run: probes $probes GFLOP/s; plan $first from them, $job at the job's end (early re-balance: $moved), $plan at rest"
  # probes within 15%: equal work (4 + 4 layers beat 3 + 5 up to 25%)
  if awk -v p="$probes" 'BEGIN { split(p, g, " "); r = g[1] / g[2]; exit !(r >= 1 / 1.15 && r <= 1.15) }'; then
    even=$((even + 1))
    check test "$first" = "0-4 4-8"
  fi
  # then even, or NEAR layers off it: measured times on a shared machine
  # can differ by more than --replan-margin, two judgements in a row (seen
  # in a CI run: one run of five ended 0-5 5-8 after three re-plans)
  for p in "$job" "$plan"; do
    check near_even "$p"
  done
  check cmp "$W/run-$run.safetensors" "$W/run-1.safetensors"
  "$N" cluster down --dir "$C" > /dev/null
  [ "$run" -ge "$MIN_RUNS" ] && [ "$even" -ge "$MIN_EVEN" ] && break
done
echo "runs with probes within 15%, each planned [0, 4) + [4, 8): $even of $run"
check test "$even" -ge 1

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
held=$(last_plan "$C/coord.log" last 2)
check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck3" --out "$W/run-liar.safetensors" \
  2> "$W/train-liar.err"
moved=$(last_plan "$C/coord.log" rebalance)
given=$(last_plan "$C/coord.log" rebalance 2)
after=$(last_plan "$C/coord.log" job)
echo "a node that under-reports: plan $before ($held layers its), at the first early re-balance" \
  "$moved ($given), at the job's end $after"
grep "measured speeds\|re-plan at the checkpoint\|observed:" "$C/coord.log"
check test "$held" -lt 4
check grep -q "measured speeds call for another split after step" "$C/coord.log"
# the first re-balance gives it more layers, to even or NEAR it (a CI run
# under load went 0-6 6-8 -> 0-3 3-8 in one re-balance); later ones judge
# the new plan's measured times, and the job ends NEAR even too
check test "$given" -gt "$held"
check near_even "$moved"
check near_even "$after"
check cmp "$W/run-liar.safetensors" "$W/run-1.safetensors"
check $PY "$NL_SOURCE_DIR/tests/same_tensors.py" "$W/run-1.safetensors" "$W/ref.safetensors"

echo "test_cluster_balance: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
