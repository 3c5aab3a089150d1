#!/usr/bin/env bash
# Loading a model of at least 1 GB onto a local cluster while the
# coordinator keeps answering (issue 22 item 6): run by hand, not in CI.
#   bench/bench_load.sh BUILD_DIR [NODES] [LAYERS]
# Writes a d=512, E=8 model of LAYERS layers (default 10: 1.05 GB), starts
# NODES nodes (default 2), and queries the cluster's status every 0.2 s
# while the stages load. Prints each answer's latency, the largest, and the
# coordinator's streaming times per stage.
set -uo pipefail
B=${1:?usage: bench_load.sh BUILD_DIR [NODES] [LAYERS]}
NODES=${2:-2}
LAYERS=${3:-10}
N="$B/cli/neuroctl"
W=$(mktemp -d)
trap '"$N" cluster down --dir "$W/c" >/dev/null 2>&1; rm -rf "$W"' EXIT
# NL_TEST_GFLOPS is a test hook: BUILD_DIR must be a test build (-DNL_TEST_HOOKS=ON)
grep -aq NL_TEST_GFLOPS "$B/node/neuronode" ||
  { echo "$B is not a test build (-DNL_TEST_HOOKS=ON): its nodes ignore NL_TEST_GFLOPS" >&2; exit 2; }
export NL_TEST_GFLOPS=20
cat > "$W/big.yaml" <<YAML
hidden_dim: 512
num_layers: $LAYERS
num_heads: 8
num_kv_heads: 4
ffn_dim: 2048
num_experts: 8
vocab_size: 4096
vocab_chunk: 4096
max_seq_len: 256
YAML
"$N" init --config "$W/big.yaml" --out "$W/big.safetensors" --seed 1 || exit 1
echo "model: $(stat -c %s "$W/big.safetensors") bytes"
"$N" cluster up --dir "$W/c" --nodes "$NODES" --model "$W/big.safetensors" --memory 4G \
  --threads 1 --timeout 300 > "$W/up.log" 2>&1 &
up=$!
worst=0
while kill -0 "$up" 2>/dev/null || ! grep -q "ready" "$W/c/coord.log" 2>/dev/null; do
  [ -f "$W/c/coord/endpoint" ] || { sleep 0.1; continue; }
  s=$(date +%s.%N)
  state=$("$N" status --cluster "$W/c" --timeout 10 2>&1 | head -1)
  e=$(date +%s.%N)
  lat=$(awk -v a="$s" -v b="$e" 'BEGIN { printf "%.3f", b - a }')
  echo "$lat s  $state"
  worst=$(awk -v a="$worst" -v b="$lat" 'BEGIN { print (b > a ? b : a) }')
  grep -q "state: ready" "$W/c/coord.log" 2>/dev/null && break
  sleep 0.2
done
wait "$up"
grep "sent .* tensors\|loaded stage" "$W/c/coord.log" | sed 's/^.*\[coord\] //'
echo "largest status latency while loading: $worst s"
