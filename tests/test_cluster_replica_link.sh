#!/usr/bin/env bash
# --replicas auto follows the link speed the replicas measure (issue 30;
# docs/cluster.md, "Replicas on different nodes"): 2 nodes, whose
# replicas' all-reduce reports 2 kB/s (the test hook NL_TEST_LINK_BYTES_S:
# the number does not depend on how busy the machine is), come up as
# 1 stage x 2 replicas at the assumed 1 GB/s (neuroctl status says
# "assumed"); a training job's steps add up their gradients, the heartbeats
# carry the measurement, and the coordinator plans again (at a checkpoint
# of the job, or at rest after it) with the measured link: no replicas
# (one node, or 2 stages: at 2 kB/s the hop costs too), status naming the
# link speed measured, and each node's link speed (2000 bytes/s) in
# status --json. The job ends at its last step either way.
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20 # equal, fixed throughputs
export NL_TEST_LINK_BYTES_S=2000

small_config "$W/cfg.yaml" 32 4 48 64
cp "$CORPUS" "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7

C="$W/c"
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 2 --replicas auto --plan-microbatches 6 \
  --model "$W/m.safetensors" --memory 64M --threads 1 --node-timeout-ms 5000 --timeout 60
"$N" status --cluster "$C" > "$W/status-1.txt"
grep "^replicas" "$W/status-1.txt"
check grep -q "^replicas: 2 per stage .*1 x 2 [0-9.]* (link 1 GB/s assumed) (chosen)" \
  "$W/status-1.txt"

check "$N" train --cluster "$C" --data "$W/data.txt" --steps 6 --batch 12 --seq 64 \
  --microbatches 6 --lr 1e-3 --seed 1 --checkpoint-every 2 --checkpoint-dir "$W/ck" \
  --log "$W/r.jsonl" 2> "$W/r.err"
check grep -q '"step":6,' "$W/r.jsonl"
check grep -q "the replicas' link measures 2e-06 GB/s against the 1 GB/s (assumed)" "$C/coord.log"
# the re-plan: at a checkpoint of the job or at rest after it (generous:
# the machine may be busy)
for i in $(seq 1 1200); do
  "$N" status --cluster "$C" > "$W/status-2.txt" 2>/dev/null
  grep -q "^replicas: 1 per stage" "$W/status-2.txt" && break
  sleep 0.1
done
grep -E "re-plan|plan [0-9]+: stage" "$C/coord.log"
grep "^replicas" "$W/status-2.txt"
check grep -q "^replicas: 1 per stage .* [12] x 1 [0-9.]* (chosen), 1 x 2 [0-9.]* (link 2e-06 GB/s measured)" \
  "$W/status-2.txt"

# each node's link speed, the median of its measurements, in the status
# (a node's heartbeat, every second, may bring its measurement after the
# job: generous)
for i in $(seq 1 300); do
  "$N" status --cluster "$C" --json > "$W/status.json" 2>/dev/null
  [ "$(grep -o '"link_bytes_s": *[0-9]' "$W/status.json" | wc -l)" -ge 2 ] && break
  sleep 0.1
done
check $PY - "$W/status.json" <<'PY'
import json, sys
links = [n.get("link_bytes_s") for n in json.load(open(sys.argv[1]))["nodes"]]
print("links (bytes/s):", links)
assert len(links) == 2 and all(v is not None and abs(v / 2000 - 1) < 1e-3 for v in links), links
PY

check "$N" cluster down --dir "$C"
echo "test_cluster_replica_link: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
