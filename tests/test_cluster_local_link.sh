#!/usr/bin/env bash
# Local links between co-located stages (net/locallink.h, node/node_local.c;
# docs/cluster.md, "Co-located stages"): the same three-node cluster with
# local links (the default) and with --no-local-link.
#  - the nodes say they made them (each stage: its next stage's hops go on
#    a local link, its previous stage's come on one), with the ring's
#    last -> first among them; --no-local-link makes none;
#  - greedy and seeded generation give the one process's ids on both, a
#    forward its logits;
#  - a training job on both ends bit-identical (activations forward and
#    gradients back over the links), with no resume, though the links into
#    stages 1 and 2 end after step 2's last microbatch
#    (NL_TEST_LOCAL_BREAK_AFTER=8, 4 microbatches a step): that step's
#    gradients and the steps after it go on ZeroMQ;
#  - when the cluster goes down each link says what it carried;
#  - a node killed (after the training): its neighbours' links end, the
#    coordinator re-plans on the two left, which make new links to each
#    other, and generation gives the ids the cluster without links gives
#    after the same kill.
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20 # equal nodes: the planner splits the layers over all three

small_config "$W/cfg.yaml" 32 6 48 128
cp "$CORPUS" "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 3
RUN=(--data "$W/data.txt" --steps 6 --batch 8 --seq 32 --microbatches 4 --lr 3e-3 --seed 1)
PROMPT=(--prompt-tokens 72,101,108,108,111 --max-new 40)
want_greedy=$("$N" generate "${DEV[@]}" --model "$W/m.safetensors" "${PROMPT[@]}" --temperature 0 \
  --threads 1 2>/dev/null)
want_sampled=$("$N" generate "${DEV[@]}" --model "$W/m.safetensors" "${PROMPT[@]}" \
  --temperature 0.8 --seed 5 --threads 1 2>/dev/null)
tokens_file "$W/in.safetensors" 2 16
check "$N" forward "${DEV[@]}" --model "$W/m.safetensors" --tokens "$W/in.safetensors" \
  --out "$W/fwd-local.safetensors" --threads 1

for mode in local zmq; do
  C="$W/$mode"
  flag=()
  [ "$mode" = zmq ] && flag=(--no-local-link)
  # (the hook ends a link into a stage after the 8th training hop on it)
  check env NL_TEST_LOCAL_BREAK_AFTER=8 "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 3 --model "$W/m.safetensors" --memory 64M \
    --threads 1 --node-timeout-ms 3000 --timeout 60 --verify-rate 0 "${flag[@]}"
  check test "$("$N" status --cluster "$C" 2>/dev/null | grep -c serving)" -eq 3
  got=$("$N" generate --cluster "$C" "${PROMPT[@]}" --temperature 0 2>/dev/null)
  check test "$got" = "$want_greedy"
  got=$("$N" generate --cluster "$C" "${PROMPT[@]}" --temperature 0.8 --seed 5 2>/dev/null)
  check test "$got" = "$want_sampled"
  check "$N" forward --cluster "$C" --tokens "$W/in.safetensors" --out "$W/fwd-$mode.safetensors"
  check $PY "$NL_SOURCE_DIR/tests/same_tensors.py" "$W/fwd-local.safetensors" "$W/fwd-$mode.safetensors"
  made=$(cat "$C"/node-*.log | grep -c "the next stage's hops go on a local link")
  came=$(cat "$C"/node-*.log | grep -c "the previous stage's hops come on a local link")
  echo "$mode: $made links made, $came taken"
  if [ "$mode" = local ]; then
    check test "$made" -eq 3 # 0 -> 1, 1 -> 2 and the ring's 2 -> 0
    check test "$came" -eq 3
  else
    check test "$made" -eq 0
    check test "$came" -eq 0
    check test "$(cat "$C"/node-*.log | grep -c "local link")" -eq 0
  fi
  check "$N" train --cluster "$C" "${RUN[@]}" --log "$W/$mode.jsonl" --out "$W/$mode.safetensors" \
    --checkpoint-dir "$W/ck-$mode" 2> "$W/$mode.err"
  check grep -q "on 3 pipeline stages" "$W/$mode.err"
  check test "$(cat "$C"/node-*.log | grep -c "ended by NL_TEST_LOCAL_BREAK_AFTER")" -eq \
    "$([ "$mode" = local ] && echo 2 || echo 0)"
  check test "$(grep -c "resum" "$C/coord.log")" -eq 0
done
# the training jobs: bit-identical with and without the links
check $PY "$NL_SOURCE_DIR/tests/same_tensors.py" "$W/local.safetensors" "$W/zmq.safetensors"
check cmp -s <(grep -o '"loss":[^,]*' "$W/local.jsonl") <(grep -o '"loss":[^,]*' "$W/zmq.jsonl")
check test "$(grep -c '"loss"' "$W/local.jsonl")" -ge 6

# a node killed: the middle stage's node (stage 1 of 3), on both clusters
for mode in local zmq; do
C="$W/$mode"
victim=$(grep -l "assigned epoch [0-9]*: stage 1 of 3" "$C"/node-*.log | head -1)
victim=${victim%.log}
check test -n "$victim"
kill -9 "$(cat "$victim.pid")"
check wait_replanned "$C"
check test "$("$N" status --cluster "$C" | grep -c serving)" -eq 2
# the stages reload the trained weights (the job's last checkpoint): the
# two clusters' generations must agree with each other
"$N" generate --cluster "$C" "${PROMPT[@]}" --temperature 0 > "$W/healed-$mode.txt" 2>/dev/null
check test -s "$W/healed-$mode.txt"
if [ "$mode" = local ]; then
  # the two left made new links to each other, both ways (the ring of two)
  after=$(cat "$C"/node-*.log | grep -c "the next stage's hops go on a local link")
  echo "links made after the re-plan: $((after - 3)) more"
  check test "$after" -ge 5
  # the victim's neighbours saw their links end
  check grep -q "the local link with the .* stage .*\(closed\|broke\)" "$C"/node-*.log
fi
done
check cmp "$W/healed-local.txt" "$W/healed-zmq.txt"

# down: every node closes its links and says what they carried
for mode in local zmq; do check "$N" cluster down --dir "$W/$mode"; done
# (the two left after the kill: in each log, what follows its last plan;
# the node that goes down second may find its link already ended by the
# first, so it says "broke" rather than "closed")
carried=0
for log in "$W"/local/node-*.log; do
  grep -q "assigned epoch [0-9]*: stage [0-9] of 2" "$log" || continue
  c=$(awk '/assigned epoch [0-9]*: stage [0-9] of 2/ { n = NR } { line[NR] = $0 }
    END { for (i = n; i <= NR; i++) print line[i] }' "$log" |
    grep -c "the local link with the next stage \(closed\|broke\): [1-9][0-9]* messages sent")
  carried=$((carried + c))
done
echo "links that carried hops since the re-plan, ended at the end: $carried"
check test "$carried" -eq 2

echo "test_cluster_local_link: $pass passed, $fail failed"
test "$fail" -eq 0
