#!/usr/bin/env bash
# The scripted GPU run of issue 13, in one go, so it can be run again on any
# machine with an NVIDIA GPU:
#   0. test_ops cuda:0 (every slot against naive loops; again with
#      CUDA_LAUNCH_BLOCKING=1, so a fault is reported by the op that made it);
#   1. neuroctl selftest --device cuda:0 (FP32, then --tf32): every CUDA slot
#      against the CPU backend, and a small model's routing, logits, decode;
#   2. bench_cuda: SGEMM and memory-bound kernels against the spec sheet;
#   3. neuroctl bench --device cuda:0 on configs/bench-large.yaml and on
#      configs/bench-xl.yaml (about 4.2 GB of weights), and the same on
#      --device cpu, for the speed-up;
#   4. a mixed 2-node local cluster (one node on cuda:0, one on cpu): forward
#      logits within 1e-5 relative of a CPU-only run, greedy generation
#      equal to it.
# Every command is echoed into OUT/commands.log and its output kept in OUT
# (default $OUT, else ./bench-cuda-out); OUT/summary.txt has one line per
# step. Builds into NL_BUILD_DIR (default build-cuda) when the binaries are
# not there. Exit status: 0 when every step passed, 1 otherwise.
#
# Usage: bench/bench_cuda.sh
# Environment: OUT, NL_BUILD_DIR, DEVICE (cuda:0), CONFIGS ("bench-large
# bench-xl"), MIXED_CONFIG (bench-medium), BENCH_CUDA_ARGS (extra flags of
# bench_cuda). A dry run of the script without a GPU:
#   DEVICE=cpu-devsim CONFIGS=tiny MIXED_CONFIG=tiny \
#   BENCH_CUDA_ARGS="--square 256 --rows 64" NL_BUILD_DIR=build bench/bench_cuda.sh
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${NL_BUILD_DIR:-$SRC/build-cuda}
OUT=${OUT:-./bench-cuda-out}
DEVICE=${DEVICE:-cuda:0}
CONFIGS=${CONFIGS:-bench-large bench-xl}
MIXED_CONFIG=${MIXED_CONFIG:-bench-medium}
read -r -a BENCH_CUDA_ARGS <<<"${BENCH_CUDA_ARGS:-}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/commands.log"
SUMMARY="$OUT/summary.txt"
NEUROCTL="$BUILD/cli/neuroctl"
PY=${PYTHON:-python3}
: >"$LOG"
: >"$SUMMARY"
failed=0

# step NAME TIMEOUT_S CMD...: run CMD with stdout in OUT/NAME.out and stderr in
# OUT/NAME.err, echo it and its exit status into the log
step() {
    local name=$1 limit=$2
    shift 2
    echo "+ $*" | tee -a "$LOG"
    local t0
    t0=$(date +%s)
    timeout -s INT -k 30 "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
    local rc=$?
    echo "  exit $rc after $(($(date +%s) - t0)) s" | tee -a "$LOG"
    return $rc
}

result() { # NAME RC [NOTE]
    local what=ok
    [ "$2" -eq 0 ] || { what=FAIL; failed=1; }
    echo "$what  $1${3:+  $3}" | tee -a "$SUMMARY"
}

# ---------------------------------------------------------------- build
{
    echo "date: $(date -u +%FT%TZ)"
    echo "commit: $(git -C "$SRC" rev-parse HEAD 2>/dev/null) $(git -C "$SRC" status --short 2>/dev/null | wc -l) files changed"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
    /usr/local/cuda/bin/nvcc --version 2>&1 | tail -2
    nproc
} >"$OUT/machine.txt"
if [ ! -x "$NEUROCTL" ] || [ ! -x "$BUILD/bench/bench_cuda" ] || [ ! -e "$BUILD/lib/libnl_cuda.so" ]; then
    # everything: the CUDA module is loaded at run time, so no binary depends on it
    step configure 600 cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DNL_CUDA=ON
    step build 1800 cmake --build "$BUILD" -j "$(nproc)"
    result build $?
fi

# ---------------------------------------------------------------- 0. op tests
# the module and what it loads, then every slot against naive loops; a
# device that cannot be made fails here (never "skipped")
export NL_REQUIRE_DEVICE=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
step ldd 60 ldd "$BUILD/lib/libnl_cuda.so"
result ldd $?
step test_ops 600 "$BUILD/tests/test_ops" "$DEVICE"
result test_ops $? "$(tail -1 "$OUT/test_ops.out")"
step test_ops_blocking 600 env CUDA_LAUNCH_BLOCKING=1 "$BUILD/tests/test_ops" "$DEVICE"
result test_ops_blocking $? "$(tail -1 "$OUT/test_ops_blocking.out")"

# ---------------------------------------------------------------- 1. selftest
step selftest 600 "$NEUROCTL" selftest --device "$DEVICE"
result selftest $? "$(tail -1 "$OUT/selftest.out")"
step selftest_tf32 600 "$NEUROCTL" selftest --device "$DEVICE" --tf32
result selftest_tf32 $? "$(tail -1 "$OUT/selftest_tf32.out")"

# ---------------------------------------------------------------- 2. kernels
step bench_cuda 900 "$BUILD/bench/bench_cuda" --device "$DEVICE" --config "$SRC/configs/bench-large.yaml" \
    "${BENCH_CUDA_ARGS[@]}"
rc=$?
cp "$OUT/bench_cuda.out" "$OUT/bench_cuda.json"
result bench_cuda $rc

# ---------------------------------------------------------------- 3. model benchmarks
for cfg in $CONFIGS; do
    step "bench_${cfg}_cuda" 900 "$NEUROCTL" bench --device "$DEVICE" --config "$SRC/configs/$cfg.yaml"
    result "bench_${cfg}_cuda" $? "$(head -c 300 "$OUT/bench_${cfg}_cuda.out")"
    step "bench_${cfg}_cpu" 1800 "$NEUROCTL" bench --device cpu --config "$SRC/configs/$cfg.yaml" \
        --repeats 3 --decode-tokens 32
    result "bench_${cfg}_cpu" $? "$(head -c 300 "$OUT/bench_${cfg}_cpu.out")"
    # speed-up of the GPU over the CPU, from the two JSON lines
    $PY - "$OUT/bench_${cfg}_cuda.out" "$OUT/bench_${cfg}_cpu.out" >"$OUT/speedup_$cfg.txt" 2>&1 <<'PY'
import json, sys
def last_json(p):
    for line in reversed(open(p).read().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None
g, c = last_json(sys.argv[1]), last_json(sys.argv[2])
if not g or not c:
    sys.exit("no JSON line from one of the two runs")
for k in ("forward_tok_s", "decode_tok_s", "train_tok_s"):
    if g.get(k) and c.get(k):
        print("%s: gpu %.1f, cpu %.1f, speed-up %.1fx" % (k, g[k], c[k], g[k] / c[k]))
PY
    echo "speed-up $cfg: $(tr '\n' ';' <"$OUT/speedup_$cfg.txt")" | tee -a "$SUMMARY"
done

# ---------------------------------------------------------------- 4. mixed cluster
W="$OUT/mixed"
C="$W/cluster"
mkdir -p "$W"
cleanup() { "$NEUROCTL" cluster down --dir "$C" >/dev/null 2>&1; }
trap cleanup EXIT
step mixed_init 300 "$NEUROCTL" init --config "$SRC/configs/$MIXED_CONFIG.yaml" \
    --out "$W/m.safetensors" --seed 5
result mixed_init $?
VOCAB=$(sed -n 's/^vocab_size: *\([0-9]*\).*/\1/p' "$SRC/configs/$MIXED_CONFIG.yaml")
$PY - "$W" "${VOCAB:-256}" <<'PY'
import json, struct, sys
w, vocab = sys.argv[1], int(sys.argv[2])
toks = [(i * 7919 + 11) % vocab for i in range(3 * 21)]
h = json.dumps({"tokens": {"dtype": "I32", "shape": [3, 21], "data_offsets": [0, 4 * len(toks)]}}).encode()
h += b" " * (-len(h) % 8)
open(w + "/in.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + struct.pack("<%di" % len(toks), *toks))
PY
step mixed_up 300 "$NEUROCTL" cluster up --dir "$C" --nodes 2 --device "$DEVICE,cpu" \
    --model "$W/m.safetensors" --memory 8G --timeout 240
result mixed_up $?
"$NEUROCTL" status --cluster "$C" >"$OUT/mixed_status.txt" 2>&1
step mixed_forward_cpu 300 "$NEUROCTL" forward --device cpu --model "$W/m.safetensors" \
    --tokens "$W/in.safetensors" --out "$W/local.safetensors"
step mixed_forward_cluster 300 "$NEUROCTL" forward --cluster "$C" --tokens "$W/in.safetensors" \
    --out "$W/remote.safetensors"
$PY - "$W/local.safetensors" "$W/remote.safetensors" >"$OUT/mixed_compare.txt" 2>&1 <<'PY'
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
scale = max(abs(x) for x in a["logits"][1])
print("mixed forward: max abs diff %.3g, max |logit| %.3g, relative %.3g (tol 1e-5)" % (d, scale, d / scale))
assert d / scale <= 1e-5
PY
result mixed_forward $? "$(tail -1 "$OUT/mixed_compare.txt")"
PROMPT=72,101,108,108,111,44,32,119 # ids below 128: valid in every config
step mixed_generate_cpu 300 "$NEUROCTL" generate --device cpu --model "$W/m.safetensors" \
    --prompt-tokens $PROMPT --max-new 32 --temperature 0
step mixed_generate_cluster 300 "$NEUROCTL" generate --cluster "$C" --prompt-tokens $PROMPT \
    --max-new 32 --temperature 0
l=$(head -1 "$OUT/mixed_generate_cpu.out")
r=$(head -1 "$OUT/mixed_generate_cluster.out")
[ -n "$l" ] && [ "$l" = "$r" ]
result mixed_greedy $? "cpu: $l | cluster: $r"
cleanup

echo "results in $OUT (summary.txt, commands.log)"
exit $failed
