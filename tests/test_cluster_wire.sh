#!/usr/bin/env bash
# The wire's precision (issue 30 item 4, DESIGN.md section 8): the same
# two-stage cluster with `--wire fp32` and `--wire bf16`.
#  - bf16 training runs, and its losses stay close to FP32's (the worst
#    relative difference over the steps is printed and bounded);
#  - the tensors the stages send each other take about half the bytes
#    (counted by the nodes: "bytes of ... tensors" at the job's end);
#  - two bf16 runs are byte-identical (weights and moments), the second
#    with a microbatch more in flight on the first stage than 1F1B's
#    (--in-flight-extra 1: 3 of the step's 4 there, 1 on the last stage,
#    as the nodes' logs say): the schedule moves, the bits do not;
#  - inference over the bf16 wire: a forward's logits are close to FP32's
#    but not equal (the hops were rounded), and a generation runs.
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20 # equal nodes: two stages of three layers each

small_config "$W/cfg.yaml" 32 6 48 64
cp "$CORPUS" "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
RUN=(--data "$W/data.txt" --steps 12 --batch 8 --seq 32 --microbatches 4 --lr 3e-3 --seed 1
     --eval-every 6 --eval-batches 2)
tokens_file "$W/in.safetensors" 2 16

# bytes of tensors the nodes of cluster $1 sent in their last training job
sent_bytes() {
  local total=0 b f
  for f in "$1"/node-*.log; do
    b=$(grep -o "[0-9]* bytes of $2 tensors" "$f" | tail -1 | cut -d' ' -f1)
    total=$((total + ${b:-0}))
  done
  echo "$total"
}

# bf16 twice, each on a fresh cluster (a job starts from the weights the
# stages hold: the last job's)
for run in fp32-1 bf16-1 bf16-2; do
  wire=${run%-*}
  extra=0
  [ "$run" = bf16-2 ] && extra=1
  C="$W/$run"
  check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 2 --model "$W/m.safetensors" --memory 64M \
    --threads 1 --node-timeout-ms 3000 --timeout 60 --wire "$wire" --verify-rate 0 \
    --in-flight-extra "$extra"
  check test "$("$N" status --cluster "$C" 2>/dev/null | grep -c serving)" -eq 2
  check "$N" forward --cluster "$C" --tokens "$W/in.safetensors" --out "$W/fwd-$run.safetensors"
  check "$N" generate --cluster "$C" --prompt-tokens 72,101,108 --max-new 12 --temperature 0 \
    > "$W/gen-$run.txt"
  check "$N" train --cluster "$C" "${RUN[@]}" --checkpoint-dir "$W/ck-$run" \
    --log "$W/$run.jsonl" --out "$W/$run.safetensors" 2> "$W/$run.err"
  check grep -q "on 2 pipeline stages" "$W/$run.err"
  # the nodes log the job's summary after it ends: wait for both
  for i in $(seq 1 600); do
    [ "$(cat "$C"/node-*.log | grep -c "bytes of $wire tensors")" -ge 2 ] && break
    sleep 0.1
  done
  eval "bytes_$wire=$(sent_bytes "$C" "$wire")"
  # the microbatches each stage kept in flight, first stage first
  flight=$(cat "$C"/node-*.log | sed -n 's/.*train job [0-9]*: stage \([01]\) of 2, 4 microbatches of 2 x 32, \([0-9]*\) in flight.*/\1:\2/p' | sort | tr '\n' ' ')
  echo "$run: in flight (stage:microbatches) $flight"
  check test "$flight" = "0:$((2 + extra)) 1:1 "
  "$N" cluster down --dir "$C" > /dev/null
done

echo "tensor bytes sent: fp32 $bytes_fp32, bf16 $bytes_bf16"
check test "$bytes_fp32" -gt 0
check test "$bytes_bf16" -gt 0
# the hidden states and gradients halve; the targets that ride along to
# the last stage (I32, one per position against d = 32 floats) do not
check $PY - "$bytes_fp32" "$bytes_bf16" <<'PY'
import sys
f, b = int(sys.argv[1]), int(sys.argv[2])
print("bf16 / fp32 bytes: %.4f" % (b / f))
assert 0.5 <= b / f <= 0.52, b / f
PY
check cmp "$W/bf16-1.safetensors" "$W/bf16-2.safetensors"
check $PY - "$W/bf16-1.jsonl" "$W/bf16-2.jsonl" <<'PY'
import json, sys
a, b = ([(r["step"], r["loss"], r.get("eval_loss")) for r in map(json.loads, open(p))]
        for p in sys.argv[1:])
assert a == b and len(a) == 12, (a, b)
PY
check $PY - "$W" <<'PY'
import json, struct, sys
w = sys.argv[1]
def log(p):
    return {r["step"]: r for r in map(json.loads, open(p))}
a, b = log(w + "/bf16-1.jsonl"), log(w + "/fp32-1.jsonl")
worst = max(abs(a[k]["loss"] - b[k]["loss"]) / abs(b[k]["loss"]) for k in b)
ev = [abs(a[k]["eval_loss"] - b[k]["eval_loss"]) / b[k]["eval_loss"] for k in b if "eval_loss" in b[k]]
print("bf16 wire against fp32: worst relative loss difference %.2e over %d steps, "
      "eval %s" % (worst, len(b), ", ".join("%.2e" % e for e in ev)))
assert 0 < worst <= 5e-3, worst
assert ev and max(ev) <= 5e-3, ev
def tensor(p, name):
    d = open(p, "rb").read(); n = struct.unpack("<Q", d[:8])[0]; h = json.loads(d[8:8 + n])
    s, e = h[name]["data_offsets"]; raw = d[8 + n + s: 8 + n + e]
    return struct.unpack("<%df" % (len(raw) // 4), raw)
x, y = tensor(w + "/fwd-bf16-1.safetensors", "logits"), tensor(w + "/fwd-fp32-1.safetensors", "logits")
rel = (sum((p - q) ** 2 for p, q in zip(x, y)) / sum(q * q for q in y)) ** 0.5
print("forward logits, bf16 wire against fp32: relative error %.2e" % rel)
assert 0 < rel <= 1e-2, rel
PY
check test "$(head -1 "$W/gen-bf16-1.txt" | wc -w)" -eq 12
check cmp "$W/gen-bf16-1.txt" "$W/gen-bf16-2.txt"
check cmp "$W/fwd-bf16-1.safetensors" "$W/fwd-bf16-2.safetensors"
echo "greedy generation, fp32 wire: $(head -1 "$W/gen-fp32-1.txt")"
echo "greedy generation, bf16 wire: $(head -1 "$W/gen-bf16-1.txt")"

echo "test_cluster_wire: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
