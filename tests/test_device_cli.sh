#!/usr/bin/env bash
# --device on the node and the tools, as real processes:
#  - cuda:0 where no GPU is usable: neuronode join and the local tools
#    (serve included)
#    fail at once (exit 1) naming the missing CUDA backend, driver or
#    device; cluster up reports the node that could not start without
#    waiting for its timeout (where a GPU works, the assertions that need
#    its absence are skipped);
#  - a device name that is not one is a usage error (exit 2) that names it,
#    on every tool that takes --device; cluster up's list is checked;
#  - a cluster command leaves --device to the nodes (usage error, with why);
#  - --tf32 changes nothing on the CPU;
#  - a pipeline of a cpu-devsim node and a cpu node gives the local logits;
#  - training: two local runs on cpu-devsim give byte-identical checkpoints;
#    the header, every log record and the checkpoint's "train" metadata say
#    the device and tf32 (--tf32 too); a cpu-devsim + cpu cluster trains
#    with the losses of a cpu + cpu one (within 1e-6), and its manifest
#    names each stage's device and tf32;
#  - a GPU's memory offer: free less the reserve, capped by --memory (test
#    hook NL_TEST_DEVICE_MEM gives the CPU a GPU's memory report);
#  - a node whose device cannot train refuses a training job, reported as
#    that job's failure (test hook NL_TEST_DEVICE_NO_TRAIN);
#  - a device error while serving (test hook NL_TEST_DEVICE_FAIL) fails
#    the job with the device's error named, and the node leaves the cluster
#    and exits 1 (inference and training).
. "$(dirname "$0")/cluster_lib.sh"
# run CMD...: sets rc, out (stdout and stderr) and secs (wall time)
run() {
  local t0
  t0=$(date +%s.%N)
  out=$(timeout 60 "$@" 2>&1)
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
}
# "at once": well under the 50 s or 60 s timeouts these commands would otherwise
# wait for, with room for a loaded machine
quick() { awk -v s="$secs" 'BEGIN { exit !(s < 15) }'; }

cat > "$W/cfg.yaml" <<'YAML'
hidden_dim: 32
num_layers: 2
num_heads: 2
num_kv_heads: 1
ffn_dim: 48
num_experts: 4
vocab_size: 256
vocab_chunk: 128
max_seq_len: 64
YAML
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 3
for i in $(seq 1 50); do echo "the quick brown fox $i jumps over the lazy dog"; done > "$W/data.txt"
python3 - "$W" <<'PY' || { fail=$((fail + 1)); echo "FAIL: make the token file" >&2; }
import json, struct, sys
toks = [(i * 37 + 11) % 256 for i in range(2 * 9)]
h = json.dumps({"tokens": {"dtype": "I32", "shape": [2, 9], "data_offsets": [0, 4 * len(toks)]}}).encode()
h += b" " * (-len(h) % 8)
open(sys.argv[1] + "/in.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + struct.pack("<18i", *toks))
PY

# ---- cuda:0: a clear failure at once where no GPU is usable ----
run "$NODE" join tcp://127.0.0.1:9 --plaintext --device cuda:0 --connect-timeout 1
if grep -q "no CUDA" <<< "$out"; then
  check test $rc -eq 1
  check quick
  check grep -q "^neuronode: cuda:0: no CUDA" <<< "$out"
  echo "neuronode --device cuda:0 (${secs} s): $(tail -1 <<< "$out")"
  gpu=0
else
  echo "skipped: a GPU answers cuda:0 here ($(tail -1 <<< "$out"))"
  gpu=1
fi
if [ $gpu -eq 0 ]; then
  run "$N" forward --model "$W/m.safetensors" --tokens "$W/in.safetensors" --out "$W/x.safetensors" --device cuda:0
  check test $rc -eq 1
  check quick
  check grep -q "neuroctl forward: cuda:0: no CUDA.*(NL_ERR_UNSUPPORTED)" <<< "$out"
  run "$N" generate --model "$W/m.safetensors" --prompt-tokens 1,2 --max-new 2 --device cuda:0 --tf32
  check test $rc -eq 1
  check grep -q "neuroctl generate: cuda:0: no CUDA" <<< "$out"
  run "$N" bench --config "$W/cfg.yaml" --batch 1 --seq 8 --device cuda:0
  check test $rc -eq 1
  check grep -q "neuroctl bench: cuda:0: no CUDA" <<< "$out"
  # the batched server: the same message before it listens
  run "$N" serve --model "$W/m.safetensors" --http 127.0.0.1:0 --device cuda:0
  check test $rc -eq 1
  check quick
  check grep -q "neuroctl serve: cuda:0: no CUDA" <<< "$out"
  check test "$(grep -c "on http://" <<< "$out")" -eq 0
  # a 1-node cluster whose node cannot open its device: said at once
  run "$N" cluster up --dir "$W/c-cuda" --nodes 1 --config "$W/cfg.yaml" --device cuda:0 --timeout 50
  check test $rc -eq 1
  check awk -v s="$secs" 'BEGIN { exit !(s < 20) }'
  check grep -q "cluster up: node-1 exited with status 1: neuronode: cuda:0: no CUDA" <<< "$out"
  "$N" cluster down --dir "$W/c-cuda" >/dev/null 2>&1
fi
# training on cuda:0: no CUDA here, or refused as a device that cannot train yet
run "$N" train --model "$W/m.safetensors" --data "$W/data.txt" --steps 1 --batch 2 --seq 8 --device cuda:0
check test $rc -eq 1
check grep -Eq "cuda:0: (no CUDA|training on this device is not available yet)" <<< "$out"
check test ! -e "$W/checkpoints"

# ---- a device that is not one: a usage error naming it ----
run "$NODE" join tcp://127.0.0.1:9 --plaintext --memory 64M --device bogus
check test $rc -eq 2
check grep -qF -- "--device bogus: unknown (use cpu, cpu-devsim or cuda:N)" <<< "$out"
for cmd in "forward --model $W/m.safetensors --tokens $W/in.safetensors --out $W/x.safetensors" \
           "generate --model $W/m.safetensors --prompt-tokens 1,2" \
           "bench --config $W/cfg.yaml" \
           "train --model $W/m.safetensors --data $W/data.txt --steps 1" \
           "grad --model $W/m.safetensors --batch $W/in.safetensors --out $W/x.safetensors"; do
  # shellcheck disable=SC2086
  run "$N" $cmd --device bogus
  check test $rc -eq 2
  check grep -qF -- "--device bogus: unknown" <<< "$out"
done
run "$NODE" join tcp://127.0.0.1:9 --plaintext --memory 64M --device cuda:x
check test $rc -eq 2
check grep -qF -- "--device cuda:x: unknown" <<< "$out"
run "$NODE" join tcp://127.0.0.1:9 --plaintext --device cpu
check test $rc -eq 2
check grep -qF -- "--memory SIZE is required on --device cpu" <<< "$out"
run "$N" cluster up --dir "$W/c-bad" --nodes 2 --config "$W/cfg.yaml" --device cpu,bogus
check test $rc -eq 2
check grep -qF -- "--device bogus: unknown" <<< "$out"
run "$N" cluster up --dir "$W/c-bad" --nodes 2 --config "$W/cfg.yaml" --device cpu,cpu,cpu
check test $rc -eq 2
check grep -qF -- "more devices than --nodes" <<< "$out"
run "$N" cluster up --dir "$W/c-bad" --nodes 2 --config "$W/cfg.yaml" --device cpu,,cpu
check test $rc -eq 2
check test ! -e "$W/c-bad/coord.pid"
# a cluster command computes on the nodes
run "$N" forward --cluster "$W/c-bad" --tokens "$W/in.safetensors" --out "$W/x.safetensors" --device cpu
check test $rc -eq 2
check grep -qF -- "--device: each node has its own --device" <<< "$out"
run "$N" generate --cluster "$W/c-bad" --prompt-tokens 1 --tf32
check test $rc -eq 2
check grep -qF -- "--tf32: each node has its own --tf32" <<< "$out"
run "$N" train --cluster "$W/c-bad" --data "$W/data.txt" --steps 1 --device cpu
check test $rc -eq 2
check grep -qF -- "--device: each node has its own --device" <<< "$out"

# ---- --tf32 is a GPU switch: the CPU's logits are the same ----
check "$N" forward "${DEV[@]}" --model "$W/m.safetensors" --tokens "$W/in.safetensors" --out "$W/a.safetensors"
check "$N" forward "${DEV[@]}" --tf32 --model "$W/m.safetensors" --tokens "$W/in.safetensors" --out "$W/b.safetensors"
check cmp "$W/a.safetensors" "$W/b.safetensors"
run "$N" bench "${DEV[@]}" --config "$W/cfg.yaml" --batch 2 --seq 8 --decode-tokens 4 --repeats 1 --threads 2
check test $rc -eq 0
check grep -q "\"device\":\"${NL_TEST_DEVICE:-cpu}\".*\"train_tok_s\":[0-9]" <<< "$out"

# ---- a mixed pipeline: the simulated device and the CPU, each node its own ----
# both nodes report one throughput (NL_TEST_GFLOPS), so the plan is two
# stages whatever the start-up probes of two processes on a busy machine say
C="$W/c-mixed"
check env NL_TEST_GFLOPS=20 "$N" cluster up --dir "$C" --nodes 2 --model "$W/m.safetensors" \
  --memory 64M --threads 1 --device cpu-devsim,cpu --timeout 60
st=$("$N" status --cluster "$C")
check grep -Eq "^[0-9]+ +serving +cpu-devsim " <<< "$st"
check grep -Eq "^[0-9]+ +serving +cpu " <<< "$st"
check "$N" forward --cluster "$C" --tokens "$W/in.safetensors" --out "$W/mixed.safetensors"
check python3 - "$W/a.safetensors" "$W/mixed.safetensors" <<'PY'
import json, struct, sys
def load(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    s, e = h["logits"]["data_offsets"]; raw = b[8 + n + s: 8 + n + e]
    return h["logits"]["shape"], struct.unpack("<%df" % (len(raw) // 4), raw)
(sa, a), (sb, b) = load(sys.argv[1]), load(sys.argv[2])
assert sa == sb, (sa, sb)
d = max(abs(x - y) for x, y in zip(a, b))
print("mixed pipeline: max abs diff %.3g against the local forward" % d)
assert d <= 1e-6, d
PY
l=$("$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 5,6,7 --max-new 8 --temperature 0 --threads 1 | head -1)
r=$("$N" generate --cluster "$C" --prompt-tokens 5,6,7 --max-new 8 --temperature 0 | head -1)
check test -n "$l"
check test "$l" = "$r"
check "$N" cluster down --dir "$C"

# ---- training on the simulated device: reproducible, reported, and the same in a mixed pipeline ----
TR=(--data "$W/data.txt" --steps 6 --batch 4 --seq 16 --microbatches 2 --lr 3e-3 --seed 2)
for r in 1 2; do
  run "$N" train --device cpu-devsim --model "$W/m.safetensors" "${TR[@]}" --threads 1 \
    --log "$W/dev$r.jsonl" --out "$W/dev$r.safetensors"
  check test $rc -eq 0
done
check cmp "$W/dev1.safetensors" "$W/dev2.safetensors"
check grep -q "in 2 microbatches on cpu-devsim (TF32 off)" <<< "$out"
check test "$(grep -c '"device":"cpu-devsim","tf32":false}$' "$W/dev1.jsonl")" -eq 6
run "$N" train --device cpu --tf32 --model "$W/m.safetensors" "${TR[@]}" --threads 1 \
  --log "$W/tf32.jsonl" --out "$W/tf32.safetensors"
check test $rc -eq 0
check grep -q "on cpu (TF32 on)" <<< "$out"
check grep -q '"device":"cpu","tf32":true}$' "$W/tf32.jsonl"
# the checkpoint's "train" metadata says where it was trained
cat > "$W/meta.py" <<'PY'
import json, struct, sys
b = open(sys.argv[1], "rb").read(); n = struct.unpack("<Q", b[:8])[0]
t = json.loads(json.loads(b[8:8 + n])["__metadata__"]["train"])
assert t["device"] == sys.argv[2] and t["tf32"] is (sys.argv[3] == "true"), t
PY
check python3 "$W/meta.py" "$W/dev1.safetensors" cpu-devsim false
check python3 "$W/meta.py" "$W/tf32.safetensors" cpu true
# a cpu-devsim node and a cpu node train as two cpu nodes do, loss for loss
# (both nodes report the same throughput, so the plan is the same two
# stages however the probes of two processes sharing two cores come out)
for D in cpu-devsim,cpu cpu,cpu; do
  C="$W/c-train-${D/,/-}"
  check env NL_TEST_GFLOPS=20 "$N" cluster up --dir "$C" --nodes 2 --model "$W/m.safetensors" \
    --memory 64M --threads 1 --device "$D" --timeout 60
  run "$N" train --cluster "$C" "${TR[@]}" --log "$C.jsonl" --checkpoint-every 6 --checkpoint-dir "$C-ck"
  check test $rc -eq 0
  check grep -Eq "on 2 pipeline stages \(devices (cpu-devsim,cpu|cpu,cpu-devsim|cpu,cpu)\)" <<< "$out"
  check "$N" cluster down --dir "$C"
done
check python3 - "$W/c-train-cpu-devsim-cpu" "$W/c-train-cpu-cpu" <<'PY'
import json, sys
mixed, cpu = ([json.loads(l) for l in open(p + ".jsonl")] for p in sys.argv[1:3])
assert len(mixed) == len(cpu) == 6, (len(mixed), len(cpu))
for a, b in zip(mixed, cpu):
    assert a["step"] == b["step"] and a["tf32"] is None, (a, b)
    e = abs(a["loss"] - b["loss"]) / abs(b["loss"])
    assert e <= 1e-6, (a["step"], a["loss"], b["loss"])
assert sorted(mixed[0]["device"].split(",")) == ["cpu", "cpu-devsim"], mixed[0]["device"]
# the manifest names each stage's device and tf32
m = json.load(open(sys.argv[1] + "-ck/step-000006/manifest.json"))
assert sorted(s["device"] for s in m["shards"]) == ["cpu", "cpu-devsim"], m["shards"]
assert all(s["tf32"] is False for s in m["shards"]), m["shards"]
print("cpu-devsim,cpu against cpu,cpu: %d steps, same losses; manifest devices %s"
      % (len(mixed), [s["device"] for s in m["shards"]]))
PY

# ---- a node that cannot train refuses the training job, which fails ----
C="$W/c-notrain"
NL_TEST_DEVICE_NO_TRAIN=1 "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 1 --model "$W/m.safetensors" \
  --memory 64M --threads 1 --timeout 60 > /dev/null 2>&1
check test $? -eq 0
run "$N" train --cluster "$C" --data "$W/data.txt" --steps 2 --batch 2 --seq 8 --timeout 20
check test $rc -eq 1
check grep -q "job [0-9]* failed: node 1 (stage 0): ${NL_TEST_DEVICE:-cpu}: training on this device is not available yet" <<< "$out"
echo "$out" | tail -1
# ... and still serves inference
check "$N" forward --cluster "$C" --tokens "$W/in.safetensors" --out "$W/c.safetensors"
check "$N" cluster down --dir "$C"

# ---- a device error while serving: the job fails naming it, the node leaves ----
# the node's checks: 1 after its throughput probe, 2 after LOAD_DONE, 3 after
# the first forward
C="$W/c-fail"
NL_TEST_DEVICE_FAIL=3 "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 1 --model "$W/m.safetensors" \
  --memory 64M --threads 1 --node-timeout-ms 10000 --timeout 60 > /dev/null 2>&1
check test $? -eq 0
pid=$(cat "$C/node-1.pid")
run "$N" forward --cluster "$C" --tokens "$W/in.safetensors" --out "$W/x.safetensors" --timeout 20
check test $rc -eq 1
check grep -q "device ${NL_TEST_DEVICE:-cpu}: injected device error (NL_TEST_DEVICE_FAIL)" <<< "$out"
echo "$out" | tail -1
for i in $(seq 1 1200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
check test ! -d "/proc/$pid"
check grep -q "leaving: device ${NL_TEST_DEVICE:-cpu}: injected device error" "$C/node-1.log"
check grep -q "neuronode: device ${NL_TEST_DEVICE:-cpu}: injected device error" "$C/node-1.log"
check grep -q "left (device ${NL_TEST_DEVICE:-cpu}: injected device error" "$C/coord.log"
check "$N" cluster down --dir "$C"

# ---- a GPU's memory offer (hook NL_TEST_DEVICE_MEM=FREE,TOTAL in MiB) ----
# free less the reserve (256M or 5% of the device, whichever is larger),
# capped by --memory; more than that is refused
d=${NL_TEST_DEVICE:-cpu}
offer() { run env NL_TEST_DEVICE_MEM="$1" "$NODE" join tcp://127.0.0.1:9 --plaintext "${DEV[@]}" \
  --connect-timeout 0.2 "${@:2}"; }
offer 8000,16000
check grep -q "device $d: 8000.0 MiB free of 16000.0 MiB (its runtime holds .* MiB); reserve 800.0 MiB" <<< "$out"
check grep -q "offering 7200.0 MiB" <<< "$out"
offer 1000,2000
check grep -q "reserve 256.0 MiB" <<< "$out"
check grep -q "offering 744.0 MiB" <<< "$out"
offer 1000,2000 --memory 500M
check grep -q "offering 500.0 MiB" <<< "$out"
offer 1000,2000 --reserve 100M
check grep -q "offering 900.0 MiB" <<< "$out"
offer 1000,2000 --memory 900M
check test $rc -eq 1
check grep -qF -- "--memory 900.0 MiB: device $d has 1000.0 MiB free of 2000.0 MiB, 744.0 MiB after the reserve of 256.0 MiB (--reserve)" <<< "$out"
offer 200,2000
check test $rc -eq 1
check grep -q "device $d: 200.0 MiB free, no more than the reserve of 256.0 MiB: nothing to offer" <<< "$out"

# ... and during training: the first training message's check fails the job
C="$W/c-failtrain"
NL_TEST_DEVICE_FAIL=3 "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 1 --model "$W/m.safetensors" \
  --memory 64M --threads 1 --node-timeout-ms 10000 --timeout 60 > /dev/null 2>&1
check test $? -eq 0
run "$N" train --cluster "$C" --data "$W/data.txt" --steps 2 --batch 2 --seq 8 --timeout 20
check test $rc -eq 1
check grep -q "job [0-9]* failed: node 1 (stage 0): device ${NL_TEST_DEVICE:-cpu}: injected device error" <<< "$out"
echo "$out" | tail -1
for i in $(seq 1 1200); do grep -q "^neuronode: device" "$C/node-1.log" && break; sleep 0.05; done
check grep -q "leaving: device ${NL_TEST_DEVICE:-cpu}: injected device error" "$C/node-1.log"
check "$N" cluster down --dir "$C"

# the node's exit status: a device failing at its start (the probe's check)
run env NL_TEST_DEVICE_FAIL=1 "$NODE" join tcp://127.0.0.1:9 --plaintext --memory 64M "${DEV[@]}"
check test $rc -eq 1
check quick
check grep -q "the throughput probe failed: injected device error" <<< "$out"

echo "test_device_cli: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
