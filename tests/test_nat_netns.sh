#!/usr/bin/env bash
# A node behind NAT, for real (issue 30 item 5): the coordinator and three
# nodes each in a network namespace, joined by veth pairs to a bridge in a
# hub namespace (10.77.1.0/24, as test_chaos). In node 2's namespace an
# iptables rule drops every inbound TCP connection (SYN); node 2 joins with
# --no-inbound and still serves its stage: it dials its previous stage,
# greedy generation gives the local tool's ids, and a training job ends
# bit-identical to the same job on a loopback cluster of ordinary nodes.
# Then again with node 2 saying nothing and the coordinator started with
# --probe-inbound: it finds node 2's data endpoint closed, and plans it so.
# Last, node 3 drops inbound connections too: the two neighbours dial the
# coordinator's relay, which passes their hops; the same results.
# Needs root, `ip netns` and iptables; skipped (77) with a message otherwise.
set -uo pipefail
N="$NL_BUILD_DIR/cli/neuroctl"
COORD="$NL_BUILD_DIR/coordinator/neurocoord"
NODE="$NL_BUILD_DIR/node/neuronode"
P=nlnat$$
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v iptables >/dev/null ||
  ! ip netns add "${P}probe" 2>/dev/null; then
  echo "skipped: test_nat_netns needs root, ip netns and iptables"
  exit 77
fi
if ! ip netns exec "${P}probe" iptables -A INPUT -p tcp --syn -j DROP 2>/dev/null; then
  ip netns del "${P}probe"
  echo "skipped: test_nat_netns needs iptables in a network namespace"
  exit 77
fi
ip netns del "${P}probe"
export NL_TEST_GFLOPS=20
W=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  "$N" cluster down --dir "$W/ref" >/dev/null 2>&1
  for ns in hub c n1 n2 n3; do ip netns del "$P$ns" 2>/dev/null; done
  rm -rf "$W"
}
trap cleanup EXIT
pass=0
fail=0
check() { if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $*" >&2; fi; }
PY=/usr/bin/python3

# ---- the network: hub with a bridge; c, n1..n3 each with one veth ----
. "$NL_SOURCE_DIR/tests/netns_lib.sh"
netns_hub "$P" 10.77.1 nln
# node 2 (10.77.1.3) accepts no inbound connection: its first packets are dropped
ip netns exec "${P}n2" iptables -A INPUT -p tcp --syn -j DROP

cat > "$W/cfg.yaml" <<'YAML'
hidden_dim: 32
num_layers: 3
num_heads: 4
num_kv_heads: 2
ffn_dim: 48
num_experts: 4
vocab_size: 256
vocab_chunk: 256
max_seq_len: 64
YAML
head -c 32340 "$NL_SOURCE_DIR/tests/data/corpus.txt" > "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
RUN=(--data "$W/data.txt" --steps 6 --batch 8 --seq 32 --microbatches 2 --lr 3e-3 --seed 1)

# ---- the reference, on loopback, ordinary nodes ----
check "$N" cluster up --device cpu --dir "$W/ref" --nodes 3 --model "$W/m.safetensors" \
  --memory 64M --threads 1 --timeout 60
check "$N" train --cluster "$W/ref" "${RUN[@]}" --checkpoint-dir "$W/ck0" \
  --out "$W/ref.safetensors" 2>/dev/null
"$N" cluster down --dir "$W/ref" >/dev/null

# ---- keys, the coordinator in c, the nodes in n1..n3 ----
mkdir -p "$W/coord"
"$N" keygen --out "$W/client" >/dev/null
echo "$(cat "$W/client.pub")  # client" > "$W/coord/authorized_keys"
for k in 1 2 3; do
  "$N" keygen --out "$W/node$k" >/dev/null
  echo "$(cat "$W/node$k.pub")  # node$k" >> "$W/coord/authorized_keys"
done
CL=(--coordinator tcp://10.77.1.1:7701 --key "$W/client.key" --coordinator-key "$W/coord/coordinator.pub")
# start ROUND COORD_FLAG NODE2_FLAG [NODE3_FLAG]: a fresh coordinator (state in $W/coord,
# logs $W/ROUND-*.log) and nodes 1..3, node k in namespace nk at
# 10.77.1.(k+1), each joining before the next starts; waits for the plan
start() {
  local r=$1 k i
  rm -f "$W/coord/endpoint" "$W/coord/client_endpoint"
  ip netns exec "${P}c" "$COORD" --listen tcp://10.77.1.1:7700 --state-dir "$W/coord" \
    --model "$W/m.safetensors" --min-nodes 3 --data-root / --checkpoint-root / $2 \
    > "$W/$r-coord.log" 2>&1 &
  pids+=($!)
  for i in $(seq 1 600); do [ -f "$W/coord/endpoint" ] && break; sleep 0.1; done
  for k in 1 2 3; do
    local extra=()
    [ $k = 2 ] && [ -n "$3" ] && extra=("$3")
    [ $k = 3 ] && [ -n "${4:-}" ] && extra=("$4")
    ip netns exec "${P}n$k" "$NODE" join tcp://10.77.1.1:7700 --key "$W/node$k.key" \
      --coordinator-key "$W/coord/coordinator.pub" --memory 64M --threads 1 --name "n$k" \
      --listen "tcp://10.77.1.$((k + 1)):7701" --checkpoint-root "$W" "${extra[@]}" \
      > "$W/$r-n$k.log" 2>&1 &
    pids+=($!)
    for i in $(seq 1 1200); do grep -q "joined tcp://" "$W/$r-n$k.log" && break; sleep 0.05; done
  done
  for i in $(seq 1 200); do
    ip netns exec "${P}c" "$N" status "${CL[@]}" --timeout 5 2>/dev/null | grep -q "ready" &&
      return 0
    sleep 0.3
  done
  return 1
}
stop() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait "${pids[@]}" 2>/dev/null
  pids=()
}
# serves ROUND: node 2 dialed its previous stage; greedy generation gives
# the local tool's ids; a training job ends bit-identical to the reference
l=$("$N" generate --device cpu --model "$W/m.safetensors" --prompt-tokens 72,101,108 --max-new 12 \
  --temperature 0 --threads 1 | head -1)
check test -n "$l"
serves() {
  local r=$1 g
  g=$(ip netns exec "${P}c" "$N" generate "${CL[@]}" --prompt-tokens 72,101,108 --max-new 12 \
    --temperature 0 --timeout 60 | head -1)
  echo "$r: local:           $l"
  echo "$r: behind the rule: $g"
  check test "$l" = "$g"
  check ip netns exec "${P}c" "$N" train "${CL[@]}" "${RUN[@]}" --checkpoint-dir "$W/ck-$r" \
    --out "$W/$r.safetensors" --timeout 120 2>"$W/$r.err"
  check $PY "$NL_SOURCE_DIR/tests/same_tensors.py" "$W/$r.safetensors" "$W/ref.safetensors"
}

# ---- node 2 says --no-inbound ----
check start flag "" --no-inbound
check grep -q "joined: .*data tcp://10.77.1.3:7701 (no inbound" "$W/flag-coord.log"
# the rule holds: node 2's data port cannot be reached from node 1, node 3's can
probe() { # NS HOST: connect within 3 s?
  ip netns exec "$P$1" timeout 3 bash -c "exec 3<>/dev/tcp/$2/7701" 2>/dev/null
}
unreachable() { ! probe "$@"; }
check probe n1 10.77.1.4
check unreachable n1 10.77.1.3
dropped=$(ip netns exec "${P}n2" iptables -L INPUT -v -n -x | awk '/DROP/ {print $1; exit}')
echo "inbound connection attempts dropped at node 2 so far: $dropped packets"
check test "${dropped:-0}" -gt 0
check grep -q "accepts no inbound connections: it dials the previous stage" "$W/flag-n2.log"
check grep -q "the link to the previous stage at .* is up" "$W/flag-n2.log"
check grep -q "the next stage dialed in" "$W/flag-n1.log" "$W/flag-n3.log"
serves flag
# each node in a network namespace of its own: a stage that offers its next
# stage a local link (docs/cluster.md, "Co-located stages") is declined,
# and the hops stay on ZeroMQ
check grep -q "the next stage declined the local link: another host" "$W"/flag-n*.log
check test "$(cat "$W"/flag-n*.log | grep -c "on a local link")" -eq 0
stop

# ---- node 2 says nothing; the coordinator finds its endpoint closed ----
check start probe --probe-inbound ""
check grep -q "data endpoint tcp://10.77.1.3:7701 did not answer a connection within 2 s: it is planned as a node that accepts no inbound" \
  "$W/probe-coord.log"
check test "$(grep -c "its data endpoint tcp://10.77.1.[24]:7701 accepts connections" \
  "$W/probe-coord.log")" -eq 2
check grep -q "accepts no inbound connections: it dials the previous stage" "$W/probe-n2.log"
check grep -q "the link to the previous stage at .* is up" "$W/probe-n2.log"
serves probe
stop

# ---- nodes 2 and 3 both drop inbound connections: neighbours in a ring of
# three, joined by the coordinator's relay ----
ip netns exec "${P}n3" iptables -A INPUT -p tcp --syn -j DROP
check unreachable n1 10.77.1.4
check start relay "" --no-inbound --no-inbound
check grep -q "relay listening on tcp://10.77.1.1:" "$W/relay-coord.log"
check grep -q "relay: 1 pair(s) of neighbouring stages pass through it" "$W/relay-coord.log"
check grep -q "it dials the relay at tcp://10.77.1.1:" "$W/relay-n2.log" "$W/relay-n3.log"
check grep -q "its hops go through the relay at tcp://10.77.1.1:" "$W/relay-n2.log" \
  "$W/relay-n3.log"
serves relay
stop
check grep -q "relay: passed [1-9][0-9]* messages" "$W/relay-coord.log"

if [ "$fail" -gt 0 ]; then
  for f in "$W"/*.log "$W"/*.err; do echo "== $f"; tail -20 "$f"; done
fi
echo "test_nat_netns: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
