#!/usr/bin/env bash
# Nodes behind NAT on loopback (issue 30 item 5): a node that accepts no
# inbound connections (neuronode join --no-inbound) still serves its stage.
# Three stages, one of them on such a node: the coordinator has it dial its
# previous stage (ASSIGN.links), which takes its hops back over that
# connection; a training job ends bit-identical to the same job on a
# cluster of ordinary nodes, and greedy generation (whose token ring runs
# from the last stage to the first) gives the same ids as the local tool.
# Two neighbouring nodes that both accept nothing both dial the
# coordinator's relay, which passes their hops: the same again. tests/test_nat_netns.sh runs the same with the
# node's inbound connections really dropped (network namespaces, iptables).
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20
pids=()
test_cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }

small_config "$W/cfg.yaml" 32 3 48 64
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
corpus_small > "$W/data.txt"
RUN=(--data "$W/data.txt" --steps 6 --batch 8 --seq 32 --microbatches 2 --lr 3e-3 --seed 1)

# ---- the reference: ordinary nodes ----
check "$N" cluster up "${DEV[@]}" --dir "$W/ref" --nodes 3 --model "$W/m.safetensors" \
  --memory 64M --threads 1 --timeout 60
check "$N" train --cluster "$W/ref" "${RUN[@]}" --checkpoint-dir "$W/ck0" --out "$W/ref.safetensors" \
  2>/dev/null
"$N" cluster down --dir "$W/ref" >/dev/null

# ---- a coordinator and three nodes, one with --no-inbound (NOINB) ----
# start_cluster DIR NOINB...: nodes 1..3, those named in NOINB with --no-inbound;
# each joins before the next starts, so node k is the k-th to join
start_cluster() {
  local d=$1
  shift
  mkdir -p "$d/coord"
  "$N" keygen --out "$d/client" >/dev/null
  echo "$(cat "$d/client.pub")  # client" > "$d/coord/authorized_keys"
  for k in 1 2 3; do
    "$N" keygen --out "$d/node$k" >/dev/null
    echo "$(cat "$d/node$k.pub")  # node$k" >> "$d/coord/authorized_keys"
  done
  "$COORD" --listen 'tcp://127.0.0.1:*' --client-listen 'tcp://127.0.0.1:*' --state-dir "$d/coord" \
    --model "$W/m.safetensors" --min-nodes 3 --data-root / --checkpoint-root / \
    > "$d/coord.log" 2>&1 &
  pids+=($!)
  for i in $(seq 1 600); do [ -s "$d/coord/endpoint" ] && break; sleep 0.1; done
  for k in 1 2 3; do
    local extra=()
    for x in "$@"; do [ "$x" = "$k" ] && extra=(--no-inbound); done
    "$NODE" join "${DEV[@]}" "$(cat "$d/coord/endpoint")" --key "$d/node$k.key" \
      --coordinator-key "$d/coord/coordinator.pub" --memory 64M --threads 1 --name "n$k" \
      --checkpoint-root / "${extra[@]}" > "$d/n$k.log" 2>&1 &
    pids+=($!)
    for i in $(seq 1 1200); do [ -n "$(node_id "$d" $k)" ] && break; sleep 0.05; done
  done
  CL=(--coordinator "$(cat "$d/coord/client_endpoint")" --key "$d/client.key"
      --coordinator-key "$d/coord/coordinator.pub")
  for i in $(seq 1 300); do
    "$N" status "${CL[@]}" --timeout 5 2>/dev/null | grep -q "ready" && return 0
    sleep 0.2
  done
  return 1
}
# the coordinator's id of node k (its log names the key's first 8 characters),
# the stage of node k in the last plan, and the node k of stage s
node_id() { # DIR K
  grep -F "key $(head -c 8 "$1/node$2.pub")..." "$1/coord.log" | grep -o "node [0-9]* joined" |
    tail -1 | awk '{print $2}'
}
stage_of() { # DIR K
  grep -o "plan [a-z0-9]*: stage [0-9]* on node $(node_id "$1" "$2"):" "$1/coord.log" | tail -1 |
    awk '{print $4}'
}
node_of_stage() { # DIR S
  local id k
  id=$(grep -o "plan [a-z0-9]*: stage $2 on node [0-9]*" "$1/coord.log" | tail -1 | awk '{print $NF}')
  for k in 1 2 3; do [ "$(node_id "$1" $k)" = "$id" ] && echo "$k"; done
}

# node 2 accepts nothing: whichever stage it serves, it dials the stage
# before it (the last, for stage 0's token ring)
C="$W/nat"
check start_cluster "$C" 2
check grep -q "joined: .*(no inbound: it dials its neighbours)" "$C/coord.log"
s=$(stage_of "$C" 2)
p=$(node_of_stage "$C" $(((s + 2) % 3)))
echo "node 2 (no inbound) serves stage $s; the stage before it is on node $p"
check grep -q "accepts no inbound connections: it dials the previous stage" "$C/n2.log"
check grep -q "the link to the previous stage at .* is up" "$C/n2.log"
check grep -q "the next stage dialed in" "$C/n$p.log"
l=$("$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 72,101,108 --max-new 12 \
  --temperature 0 --threads 1 | head -1)
r=$("$N" generate "${CL[@]}" --prompt-tokens 72,101,108 --max-new 12 --temperature 0 | head -1)
echo "local:  $l"
echo "no-inb: $r"
check test -n "$l"
check test "$l" = "$r"
# then a training job: the weights stay trained on the stages
check "$N" train "${CL[@]}" "${RUN[@]}" --checkpoint-dir "$W/ck1" --out "$W/nat.safetensors" \
  2>"$W/nat.err"
check $PY "$NL_SOURCE_DIR/tests/same_tensors.py" "$W/nat.safetensors" "$W/ref.safetensors"
# the other links were made the usual way: every node but the one before node 2
# connected to its next stage (the last to the first for the token ring)
for k in 1 2 3; do
  [ "$k" = "$p" ] || check grep -q "connected to the next stage at" "$C/n$k.log"
done
test_cleanup
pids=()

# two nodes that accept nothing are neighbours in a ring of three: both dial
# the coordinator's relay, which passes their hops; the third link flips as
# above
C="$W/relay"
check start_cluster "$C" 1 2
check grep -q "relay listening on tcp://127.0.0.1:" "$C/coord.log"
check grep -q "relay: 1 pair(s) of neighbouring stages pass through it" "$C/coord.log"
check grep -q "nor does the previous stage at .*: it dials the relay at" "$C/n1.log" "$C/n2.log"
check grep -q "the next stage accepts no inbound connections either: its hops go through the relay" \
  "$C/n1.log" "$C/n2.log"
check grep -q "accepts no inbound connections: it dials the previous stage at" "$C/n1.log" \
  "$C/n2.log"
r=$("$N" generate "${CL[@]}" --prompt-tokens 72,101,108 --max-new 12 --temperature 0 | head -1)
echo "relayed: $r"
check test "$l" = "$r"
check "$N" train "${CL[@]}" "${RUN[@]}" --checkpoint-dir "$W/ck2" --out "$W/relay.safetensors" \
  2>"$W/relay.err"
check $PY "$NL_SOURCE_DIR/tests/same_tensors.py" "$W/relay.safetensors" "$W/ref.safetensors"
test_cleanup
pids=()
# (a HELLO that came before its other end did is dropped, and said again)
check grep -q "relay: passed [1-9][0-9]* messages" "$C/coord.log"

if [ "$fail" -gt 0 ]; then
  for f in "$W"/*/coord.log "$W"/*/n?.log "$W"/*.err; do echo "== $f"; tail -25 "$f"; done
fi
echo "test_cluster_nat: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
