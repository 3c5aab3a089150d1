#!/usr/bin/env bash
# A pipeline over a slow, distant link (issue 30 item 7): the coordinator
# and NODES 1-thread nodes (default 2), each in a network namespace, joined by veth pairs
# to a bridge; every namespace's outgoing link is shaped to RATE (tc tbf)
# and delayed DELAY_MS one way, so RTT = 2 DELAY_MS between any two
# (tc netem where the kernel has sch_netem, else a netfilter queue held by
# tests/netdelay.c). The same training job runs there and on loopback,
# each with --wire fp32 and --wire bf16; prints one JSON summary:
# training tokens/s (median of the steps after the first 2) per run, and
# the ratios the issue asks for (bf16 / fp32 on the shaped link, shaped /
# loopback with bf16).
#   bench/bench_wan.sh [BUILD_DIR]
# Settings (environment, with defaults): NODES=2 RATE=100mbit DELAY_MS=20
# CONFIG=configs/tiny.yaml STEPS=12 BATCH=16 SEQ=128 MICRO=4
# NODE_TIMEOUT_MS=10000 (neurocoord --node-timeout-ms on the shaped link);
# VERIFY_RATE=0 (neurocoord --verify-rate: off, since each case carries its
# stage's weights to the verifier, which on a slow link outweighs the hops
# this measures; bench/bench_verify.sh measures verification);
# IN_FLIGHT_EXTRA=0 (neurocoord --in-flight-extra, both runs: microbatches
# in flight beyond 1F1B's, which hide the link's round trip);
# GFLOPS= (a test build's compute model, NL_TEST_COMPUTE_GFLOPS: each
# training hop sleeps for its FLOPs' time at GFLOPS instead of computing,
# standing for a node faster than these cores, e.g. a GPU; empty: real
# compute);
# KEEP=DIR copies the runs' logs there (the nodes', the coordinator's,
# netdelay's: how many packets it held and whether the kernel dropped any).
# Needs root, ip netns and tc; the delay without netem needs iptables'
# NFQUEUE and the test build's tests/netdelay.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build}
RATE=${RATE:-100mbit}
DELAY_MS=${DELAY_MS:-20}
CONFIG=${CONFIG:-$ROOT/configs/tiny.yaml}
STEPS=${STEPS:-12}
BATCH=${BATCH:-16}
SEQ=${SEQ:-128}
MICRO=${MICRO:-4}
NODE_TIMEOUT_MS=${NODE_TIMEOUT_MS:-10000}
VERIFY_RATE=${VERIFY_RATE:-0}
IN_FLIGHT_EXTRA=${IN_FLIGHT_EXTRA:-0}
NODES=${NODES:-2}
NS=(c)
for k in $(seq 1 "$NODES"); do NS+=("n$k"); done
GFLOPS=${GFLOPS:-}
[ -n "$GFLOPS" ] && export NL_TEST_COMPUTE_GFLOPS=$GFLOPS
KEEP=${KEEP:-}
N="$BUILD/cli/neuroctl"
COORD="$BUILD/coordinator/neurocoord"
NODE="$BUILD/node/neuronode"
ND="$BUILD/tests/netdelay"
PY=/usr/bin/python3
P=nlwan$$
[ -x "$N" ] || { echo "no $N: build first" >&2; exit 1; }
if [ "$(id -u)" != 0 ] || ! ip netns add "${P}probe" 2>/dev/null; then
  echo "bench_wan: needs root and ip netns" >&2
  exit 1
fi
ip netns del "${P}probe"
W=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done # netdelay prints its counts
  for d in "$W"/lo-*; do [ -d "$d" ] && "$N" cluster down --dir "$d" >/dev/null 2>&1; done
  for ns in hub "${NS[@]}"; do ip netns del "$P$ns" 2>/dev/null; done
  [ -n "$KEEP" ] && mkdir -p "$KEEP" && cp "$W"/*.log "$W"/*.err "$W"/*.jsonl "$KEEP"/ 2>/dev/null
  rm -rf "$W"
}
trap cleanup EXIT

# ---- the network: hub with a bridge; c, n1, n2, ... each with one veth ----
ip netns add "${P}hub"
ip -n "${P}hub" link add br0 type bridge
ip -n "${P}hub" link set br0 up
i=1
for ns in "${NS[@]}"; do
  ip netns add "$P$ns"
  ip link add "nlw$i$$" type veth peer name eth0 netns "$P$ns"
  ip link set "nlw$i$$" netns "${P}hub"
  ip -n "${P}hub" link set "nlw$i$$" master br0 up
  ip -n "$P$ns" addr add "10.78.0.$i/24" dev eth0
  ip -n "$P$ns" link set eth0 up
  ip -n "$P$ns" link set lo up
  i=$((i + 1))
done
# the delay: netem with the rate as its child, else tbf and a netfilter queue
delay=netem
for ns in "${NS[@]}"; do
  if ! ip netns exec "$P$ns" tc qdisc add dev eth0 root handle 1: netem delay "${DELAY_MS}ms" \
    2>/dev/null; then
    delay=nfqueue
    break
  fi
  ip netns exec "$P$ns" tc qdisc add dev eth0 parent 1: handle 2: tbf rate "$RATE" burst 64kb \
    latency 400ms
done
if [ $delay = nfqueue ]; then
  [ -x "$ND" ] || { echo "bench_wan: no netem and no $ND (a test build)" >&2; exit 1; }
  FIFO=
  chrt -f 10 true 2>/dev/null && FIFO="chrt -f 10" && delay="nfqueue, netdelay SCHED_FIFO"
  [ -n "$FIFO" ] || echo "bench_wan: chrt -f refused: netdelay at normal priority (a busy machine slows the link)" >&2
  for ns in "${NS[@]}"; do
    ip netns exec "$P$ns" tc qdisc del dev eth0 root 2>/dev/null
    ip netns exec "$P$ns" tc qdisc add dev eth0 root tbf rate "$RATE" burst 64kb latency 400ms
    # each namespace delays what it receives, not what it sends: a packet
    # held on the sender's way out still counts against its socket's TCP
    # Small Queues budget (about 1 ms of data), which then sent a window a
    # 20 ms hold at a time: 2.3 Mbit/s on this 100 Mbit/s link. netem
    # orphans the packets it holds; a netfilter queue does not
    ip netns exec "$P$ns" iptables -A INPUT -i eth0 -j NFQUEUE --queue-num 0 --queue-bypass ||
      { echo "bench_wan: no NFQUEUE" >&2; exit 1; }
    # the wire itself must not wait for a core: on a busy machine a
    # netdelay at normal priority held packets for seconds past their
    # delay (links at 4 Mbit/s, heartbeats late, nodes taken for dead), so
    # it runs SCHED_FIFO where chrt may (its work is a little per packet)
    ip netns exec "$P$ns" $FIFO "$ND" 0 "$DELAY_MS" 0 1 > "$W/netdelay-$ns.log" 2>&1 &
    pids+=($!)
  done
  sleep 0.3
fi
echo "bench_wan: $RATE, ${DELAY_MS} ms each way ($delay); $STEPS steps of $BATCH x $SEQ in $MICRO" \
  "microbatches, $(basename "$CONFIG")" >&2
# the RTT as ping sees it, where there is ping
rtt=$(ip netns exec "${P}n1" ping -c 3 -i 0.3 10.78.0.3 2>/dev/null | sed -n 's|.*= [0-9.]*/\([0-9.]*\)/.*|\1|p')

"$N" init --config "$CONFIG" --out "$W/m.safetensors" --seed 7 >/dev/null
cp "$ROOT"/tests/data/corpus.txt "$W/data.txt"
RUN=(--data "$W/data.txt" --steps "$STEPS" --batch "$BATCH" --seq "$SEQ" --microbatches "$MICRO"
     --lr 1e-3 --seed 1)
mkdir -p "$W/coord"
"$N" keygen --out "$W/client" >/dev/null
echo "$(cat "$W/client.pub")  # client" > "$W/coord/authorized_keys"
for k in $(seq 1 "$NODES"); do
  "$N" keygen --out "$W/node$k" >/dev/null
  echo "$(cat "$W/node$k.pub")  # node$k" >> "$W/coord/authorized_keys"
done
CL=(--coordinator tcp://10.78.0.1:7801 --key "$W/client.key" --coordinator-key "$W/coord/coordinator.pub")

# shaped WIRE: the coordinator and both nodes in the namespaces, one job
shaped() {
  local p0=${#pids[@]}
  ip netns exec "${P}c" "$COORD" --listen tcp://10.78.0.1:7800 --state-dir "$W/coord" \
    --model "$W/m.safetensors" --min-nodes "$NODES" --node-timeout-ms "$NODE_TIMEOUT_MS" --data-root / \
    --checkpoint-root / --wire "$1" --verify-rate "$VERIFY_RATE" \
    --in-flight-extra "$IN_FLIGHT_EXTRA" > "$W/coord-$1.log" 2>&1 &
  pids+=($!)
  for i in $(seq 1 50); do [ -f "$W/coord/coordinator.pub" ] && break; sleep 0.1; done
  for k in $(seq 1 "$NODES"); do
    ip netns exec "${P}n$k" "$NODE" join tcp://10.78.0.1:7800 --key "$W/node$k.key" \
      --coordinator-key "$W/coord/coordinator.pub" --memory 1G --threads 1 --name "n$k" \
      --listen "tcp://10.78.0.$((k + 1)):7801" --checkpoint-root "$W" > "$W/n$k-$1.log" 2>&1 &
    pids+=($!)
  done
  for i in $(seq 1 200); do
    ip netns exec "${P}c" "$N" status "${CL[@]}" --timeout 5 2>/dev/null | grep -q "ready" && break
    sleep 0.3
  done
  ip netns exec "${P}c" "$N" train "${CL[@]}" "${RUN[@]}" --checkpoint-dir "$W/ck-wan-$1" \
    --log "$W/wan-$1.jsonl" --timeout 600 2> "$W/wan-$1.err" || tail -3 "$W/wan-$1.err" >&2
  for p in "${pids[@]:$p0}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]:$p0}"; do wait "$p" 2>/dev/null; done
}
loopback() {
  "$N" cluster up --dir "$W/lo-$1" --nodes "$NODES" --threads 1 --model "$W/m.safetensors" --wire "$1" \
    --verify-rate "$VERIFY_RATE" --in-flight-extra "$IN_FLIGHT_EXTRA" \
    --timeout 120 >/dev/null 2>&1
  "$N" train --cluster "$W/lo-$1" "${RUN[@]}" --checkpoint-dir "$W/ck-lo-$1" \
    --log "$W/lo-$1.jsonl" 2> "$W/lo-$1.err" || tail -3 "$W/lo-$1.err" >&2
  "$N" cluster down --dir "$W/lo-$1" >/dev/null
}
for wire in fp32 bf16; do
  echo "bench_wan: loopback, --wire $wire" >&2
  loopback $wire
  echo "bench_wan: shaped link, --wire $wire" >&2
  shaped $wire
done

"$PY" - "$W" "$RATE" "$DELAY_MS" "$delay" "${rtt:-}" "$STEPS" "$BATCH" "$SEQ" "$MICRO" \
  "$(basename "$CONFIG")" "$IN_FLIGHT_EXTRA" "${GFLOPS:-}" "$NODES" <<'PY'
import json, os, statistics, sys
w, rate, delay_ms, how, rtt, steps, batch, seq, micro, config, extra, gflops, nodes = sys.argv[1:14]
def rate_of(name):
    p = os.path.join(w, name + ".jsonl")
    rows = [json.loads(l) for l in open(p)] if os.path.exists(p) else []
    rows = [r for r in rows if "step" in r and "tokens_per_s" in r] # not the events
    if len({r["step"] for r in rows}) < int(steps): # the job failed: no figure
        return None
    return round(statistics.median(r["tokens_per_s"] for r in rows if r["step"] > 2), 1)
r = {k: rate_of(k) for k in ("lo-fp32", "lo-bf16", "wan-fp32", "wan-bf16")}
out = {"bench": "wan", "nodes": int(nodes), "rate": rate, "delay_ms_each_way": int(delay_ms), "delay_by": how,
       "ping_rtt_ms": float(rtt) if rtt else None, "config": config, "steps": int(steps),
       "batch": int(batch), "seq": int(seq), "microbatches": int(micro),
       "in_flight_extra": int(extra), "compute_model_gflops": float(gflops) if gflops else None,
       "tokens_per_s": r}
if r["wan-fp32"] and r["wan-bf16"]:
    out["wan_bf16_over_fp32"] = round(r["wan-bf16"] / r["wan-fp32"], 3)
if r["wan-bf16"] and r["lo-bf16"]:
    out["wan_bf16_over_loopback_bf16"] = round(r["wan-bf16"] / r["lo-bf16"], 3)
if r["wan-fp32"] and r["lo-fp32"]:
    out["wan_fp32_over_loopback_fp32"] = round(r["wan-fp32"] / r["lo-fp32"], 3)
print(json.dumps(out))
PY
