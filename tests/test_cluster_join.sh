#!/usr/bin/env bash
# A join at rest (issue 22): a cluster of one node serves the whole model;
# a second node joins; within seconds the coordinator plans two stages
# (the planner's bottleneck halves, beyond --replan-margin), logs the old
# and new plan, and the stages reload from the checkpoint; forward through
# the two stages equals the local forward; cluster down stops the node
# started by hand as well as its own.
. "$(dirname "$0")/cluster_lib.sh"
# equal, fixed throughputs: the plan does not depend on probes disturbed by
# tests running beside this one
export NL_TEST_GFLOPS=20
C="$W/cluster"
extra=0
test_cleanup() { [ "$extra" -gt 0 ] && kill "$extra" 2>/dev/null && wait "$extra" 2>/dev/null; }

small_config "$W/cfg.yaml" 64 6 64 256
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 1 --model "$W/m.safetensors" --memory 64M \
  --threads 1 --node-timeout-ms 2000 --timeout 60
check test "$("$N" status --cluster "$C" | grep -c serving)" -eq 1

# a second node, with a key the coordinator is told about (SIGHUP)
"$N" keygen --out "$W/extra" >/dev/null
echo "$(cat "$W/extra.pub")  # extra" >> "$C/coord/authorized_keys"
check reload_keys "$C"
"$NODE" join "${DEV[@]}" "$(cat "$C/coord/endpoint")" --key "$W/extra.key" \
  --coordinator-key "$C/coord/coordinator.pub" --memory 64M --threads 1 --name extra \
  > "$W/extra.log" 2>&1 &
extra=$!
t0=$(date +%s.%N)
serving=0
for i in $(seq 1 600); do
  serving=$("$N" status --cluster "$C" 2>/dev/null | grep -c serving)
  [ "$serving" -eq 2 ] && "$N" status --cluster "$C" 2>/dev/null | grep -q ready && break
  sleep 0.1
done
t1=$(date +%s.%N)
elapsed=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
echo "two stages serving $elapsed s after the second node started"
check test "$serving" -eq 2
# taken in at rest, not at some later timeout: a generous bound (a loaded
# machine slows the node's start-up probe several times over)
check awk -v e="$elapsed" 'BEGIN { exit !(e <= 45.0) }'
check grep -q "re-plan at rest: bottleneck" "$C/coord.log"
check grep -q "plan old: stage 0" "$C/coord.log"
check grep -q "plan new: stage 1" "$C/coord.log"

# forward through the two stages equals the local forward
tokens_file "$W/in.safetensors" 2 17
check "$N" forward "${DEV[@]}" --model "$W/m.safetensors" --tokens "$W/in.safetensors" \
  --out "$W/local.safetensors" --threads 1
check "$N" forward --cluster "$C" --tokens "$W/in.safetensors" --out "$W/remote.safetensors"
check $PY - "$W/local.safetensors" "$W/remote.safetensors" <<'PY'
import json, struct, sys
def load(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    out = {}
    for k, v in h.items():
        if k == "__metadata__": continue
        s, e = v["data_offsets"]; raw = b[8 + n + s: 8 + n + e]
        out[k] = (v["shape"], struct.unpack("<%df" % (len(raw) // 4), raw))
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
assert a["logits"][0] == b["logits"][0], (a["logits"][0], b["logits"][0])
d = max(abs(x - y) for x, y in zip(a["logits"][1], b["logits"][1]))
print("forward after the join: max abs diff %.3g" % d)
assert d <= 1e-6, d
PY

# cluster down takes down the node started by hand too (issue 34, item 6):
# the coordinator asks every node that joined it to leave before it stops
check "$N" cluster down --dir "$C"
for i in $(seq 1 600); do kill -0 "$extra" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$extra" 2>/dev/null; then
  check false "the node started by hand outlived cluster down by 60 s"
else
  wait "$extra"
  check test $? -eq 0
  extra=0
fi
check grep -q "the coordinator asks this node to leave (the cluster is going down): stopping" \
  "$W/extra.log"
check grep -q "stopping: asked 2 node(s) to leave; 2 left, 0 did not answer" "$C/coord.log"

echo "test_cluster_join: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
