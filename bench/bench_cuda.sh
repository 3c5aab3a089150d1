#!/usr/bin/env bash
# The scripted GPU run of issues 13 and 14, in one go, so it can be run again
# on any machine with an NVIDIA GPU:
#   0. test_ops, test_ops_moe, test_ops_train cuda:0 (every slot against naive loops; again with
#      CUDA_LAUNCH_BLOCKING=1, so a fault is reported by the op that made it);
#   1. neuroctl selftest --device cuda:0 (FP32, then --tf32): every CUDA slot
#      against the CPU backend (with the model variants' GeGLU, YaRN RoPE and
#      masked attention forward and backward: encoder, local windows, packed
#      documents; cli/selftest_family.c), and a small model's routing, logits, decode
#      (and, once the device can train, one layer forward/backward and three
#      local training steps);
#   2. bench_cuda: SGEMM and memory-bound kernels against the spec sheet,
#      and decode tokens/s with routing on the device and with
#      NL_HOST_ROUTING=1 (the host round trip per layer), with the host
#      synchronisations per token of each (at most 1 with device routing:
#      the logits' download; the token and position go up through the pinned
#      staging ring without a wait; none inside the layers); and decode with
#      each step replayed from a recorded CUDA graph against every op
#      launched (decode_graphs: the ratio, the same greedy ids); and the
#      fused decode slots against the separate ones, NL_FUSED=0
#      (decode_fused: tokens/s with and without graphs, launches per token);
#      and decode with the KV cache in bf16 beside FP32 (decode_kv_bf16:
#      tokens/s, the ratio, whether the greedy ids agree); and seeded top-p
#      decode (temperature 0.8, top-p 0.95) sampled on the device against
#      the host (decode_top_p: tokens/s, host syncs per token, the same ids
#      judged); and the sample_rows slot alone (sample: microseconds a call
#      for greedy, temperature and top-p rows, 1 and 16 of them, the
#      config's vocabulary and 131072 ids); and batched
#      decode of 1, 4 and 16 sessions (decode_batch: aggregate tokens/s,
#      the same ids for session 0 in every batch), with batch-1 decode on
#      the gemm_rows kernel against cuBLAS (NL_CUDA_ROWS=cublas); and
#      batch-1 decode of each CONFIG:PRECISION of DECODE_SPECS against the
#      memory bound (decode_bound: tokens/s, host syncs per token, the
#      fraction of the limit that the bytes a token reads and the device's
#      copy bandwidth, measured in the same run, set; whether device
#      routing is slower than host routing);
#   3. neuroctl bench --device cuda:0 on configs/bench-large.yaml and on
#      configs/bench-xl.yaml (about 4.2 GB of weights), and bench-large on
#      --device cpu, for the speed-up; the device's training figures
#      (train_tok_s, train_peak_frac) must be there;
#   4. a mixed 2-node local cluster (one node on cuda:0, one on cpu): forward
#      logits within 1e-5 relative of a CPU-only run, greedy generation
#      equal to it. The nodes report equal throughputs (NL_TEST_GFLOPS=
#      MIXED_GFLOPS, default 100): the probe ranks a GPU so far above a CPU
#      that the planner would give it every layer and "mixed" would run on
#      one device (the first H100 run); the plan is checked (mixed_split:
#      2 stages, one on each device) and the part fails without it;
#   5. training (TRAIN_CONFIG, default bench-small; 20 steps, fixed seed):
#      (a) two local `neuroctl train --device cuda:0` runs of the same job
#      write byte-identical checkpoints (cmp), their header and log say the
#      device and tf32 false; a --tf32 run says tf32 true (its losses against
#      FP32 are reported, not judged); (b) a 2-node local cluster, one node on
#      cuda:0 and one on cpu, trains the job with losses within 1e-4 relative
#      of a cpu,cpu cluster's, step by step (the JSONL logs), and its
#      manifest names each stage's device and tf32; the split is forced and
#      checked as in part 4 (train_split);
#   6. data-parallel replicas, where the machine has 2 or more GPUs
#      (nvidia-smi -L), else skipped with a line that says so: one node
#      training TRAIN_CONFIG with --device cuda:0 and with cuda:0,1 (each
#      replica on its own thread, NCCL all-reduce): the tokens/s ratio of two
#      replicas over one, every step's loss within 1e-6 relative of one
#      replica, and two runs on two replicas byte-identical.
# Every command is echoed into OUT/commands.log and its output kept in OUT
# (default $OUT, else ./bench-cuda-out); OUT/summary.txt has one line per
# step. Models, checkpoints, data and cluster directories go to a scratch
# directory outside OUT (SCRATCH, default a mktemp -d, removed at exit
# unless KEEP_SCRATCH=1), so OUT holds logs only and a run's record packs
# into a small archive; the cluster and node logs are copied into OUT. Builds into NL_BUILD_DIR (default build-cuda) when the binaries are
# not there. Exit status: 0 when every step passed, 1 otherwise.
#
# Usage: bench/bench_cuda.sh
# Environment: OUT, NL_BUILD_DIR, DEVICE (cuda:0), CONFIGS ("bench-large
# bench-xl"), CPU_CONFIGS (those of CONFIGS also run on the CPU for the
# speed-up: "bench-large"), DECODE_SPECS (part 2's decode runs beside
# bench-large FP32: "bench-large:bf16 bench-xl:fp32 bench-xl:bf16"), DECODE_PROFILE (the
# precisions of part 2's profiled decode, -batch: with the batched decode:
# "fp32 bf16 fp32-batch"), DECODE_PROFILE_CONFIG
# (its config: bench-large), MIXED_CONFIG (bench-medium), TRAIN_CONFIG (bench-small),
# BENCH_CUDA_ARGS (extra flags of bench_cuda), REPLICAS (the two-replica
# device list of part 6; default cuda:0,1 where two GPUs answer),
# REPLICA_JOB (its job's size: "--steps 12 --batch 16 --seq 128
# --microbatches 4"), ONLY (a list of parts to run, e.g. "6"; default all),
# MIXED_GFLOPS (the throughput both nodes of parts 4 and 5 report: 100),
# SCRATCH, KEEP_SCRATCH, NO_BUILD (1: never build, fail when neuroctl is
# missing; bench/gpu_check.sh sets it).
# A dry run of the script
# without a GPU:
#   DEVICE=cpu-devsim CONFIGS=tiny CPU_CONFIGS=tiny MIXED_CONFIG=tiny TRAIN_CONFIG=tiny \
#   DECODE_SPECS="tiny:fp32 tiny:bf16" DECODE_PROFILE_CONFIG=tiny \
#   BENCH_CUDA_ARGS="--square 256 --rows 64" NL_BUILD_DIR=build bench/bench_cuda.sh
# and of part 6 alone on two CPU replicas:
#   ONLY=6 REPLICAS=cpu,cpu TRAIN_CONFIG=tiny REPLICA_JOB="--steps 6 --batch 8 --seq 64 \
#   --microbatches 4" NL_BUILD_DIR=build bench/bench_cuda.sh
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${NL_BUILD_DIR:-$SRC/build-cuda}
OUT=${OUT:-./bench-cuda-out}
DEVICE=${DEVICE:-cuda:0}
CONFIGS=${CONFIGS:-bench-large bench-xl}
CPU_CONFIGS=${CPU_CONFIGS:-bench-large}
DECODE_SPECS=${DECODE_SPECS-bench-large:bf16 bench-xl:fp32 bench-xl:bf16}
DECODE_PROFILE=${DECODE_PROFILE-fp32 bf16 fp32-batch}
DECODE_PROFILE_CONFIG=${DECODE_PROFILE_CONFIG:-bench-large}
MIXED_CONFIG=${MIXED_CONFIG:-bench-medium}
TRAIN_CONFIG=${TRAIN_CONFIG:-bench-small}
read -r -a BENCH_CUDA_ARGS <<<"${BENCH_CUDA_ARGS:-}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
MIXED_GFLOPS=${MIXED_GFLOPS:-100}
if [ -n "${SCRATCH:-}" ]; then
    mkdir -p "$SCRATCH"
else
    SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/bench-cuda.XXXXXX")
fi
SCRATCH=$(cd "$SCRATCH" && pwd)
case "$SCRATCH/" in "$OUT"/*)
    echo "bench_cuda.sh: SCRATCH ($SCRATCH) must not be inside OUT ($OUT)" >&2
    exit 2
    ;;
esac
# the parts define cleanup (4), cleanup_train (5), cleanup_replicas (6)
on_exit() {
    local f
    for f in cleanup cleanup_train cleanup_replicas; do
        declare -F $f >/dev/null && $f
    done
    [ "${KEEP_SCRATCH:-0}" = 1 ] || rm -rf "$SCRATCH"
}
trap on_exit EXIT
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

want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; } # PART: in ONLY (or no ONLY)

# check_split NAME CLUSTER_DIR DEVICES: the cluster's plan has exactly two
# stages, one on each of the comma-separated DEVICES (from status --json)
check_split() {
    local name=$1 dir=$2 devs=$3
    "$NEUROCTL" status --cluster "$dir" --json >"$OUT/${name}_status.json" 2>&1
    $PY - "$OUT/${name}_status.json" "$devs" >"$OUT/$name.txt" 2>&1 <<'PY'
import json, sys
st = json.load(open(sys.argv[1]))
want = sorted(sys.argv[2].split(","))
stages = sorted((n["layers"][0], n["layers"][1], n.get("device")) for n in st.get("nodes", [])
                if isinstance(n.get("layers"), list) and n["layers"][1] > n["layers"][0])
plan = ", ".join("%s [%d,%d)" % (d, a, b) for a, b, d in stages)
print("plan: %s" % (plan or "no stages"))
if sorted(d for _, _, d in stages) != want:
    sys.exit("not a 2-stage pipeline over %s: %s" % (",".join(want), plan or "no stages"))
PY
    local rc=$?
    result "$name" $rc "$(tail -1 "$OUT/$name.txt")"
    return $rc
}

# keep_logs DIR PREFIX: copy the small logs of a cluster or job directory into OUT
keep_logs() {
    local f
    find "$1" -type f \( -name '*.log' -o -name '*.jsonl' \) -size -4M 2>/dev/null | while read -r f; do
        cp "$f" "$OUT/$2_$(echo "${f#"$1"/}" | tr '/' '_')"
    done
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
if [ "${NO_BUILD:-0}" = 1 ] && [ ! -x "$NEUROCTL" ]; then # bench/gpu_check.sh: never build
    echo "bench_cuda.sh: $NEUROCTL is missing and NO_BUILD=1" >&2
    exit 2
elif [ "${NO_BUILD:-0}" != 1 ] && { [ ! -x "$NEUROCTL" ] || [ ! -x "$BUILD/bench/bench_cuda" ] ||
    [ ! -e "$BUILD/lib/libnl_cuda.so" ]; }; then
    # everything: the CUDA module is loaded at run time, so no binary depends on it
    step configure 600 cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DNL_CUDA=ON \
        -DNL_TEST_HOOKS=ON # the nodes report NL_TEST_GFLOPS (a test hook)
    step build 1800 cmake --build "$BUILD" -j "$(nproc)"
    result build $?
fi

export NL_REQUIRE_DEVICE=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# ---------------------------------------------------------------- 0. op tests
if want 0; then
# the module and what it loads, then every slot against naive loops; a
# device that cannot be made fails here (never "skipped")
step ldd 60 ldd "$BUILD/lib/libnl_cuda.so"
result ldd $?
step test_ops 600 "$BUILD/tests/test_ops" "$DEVICE"
result test_ops $? "$(tail -1 "$OUT/test_ops.out")"
step test_ops_blocking 600 env CUDA_LAUNCH_BLOCKING=1 "$BUILD/tests/test_ops" "$DEVICE"
result test_ops_blocking $? "$(tail -1 "$OUT/test_ops_blocking.out")"
step test_ops_moe 600 "$BUILD/tests/test_ops_moe" "$DEVICE"
result test_ops_moe $? "$(tail -1 "$OUT/test_ops_moe.out")"
step test_ops_train 600 "$BUILD/tests/test_ops_train" "$DEVICE"
result test_ops_train $? "$(tail -1 "$OUT/test_ops_train.out")"
step test_ops_train_blocking 600 env CUDA_LAUNCH_BLOCKING=1 "$BUILD/tests/test_ops_train" "$DEVICE"
result test_ops_train_blocking $? "$(tail -1 "$OUT/test_ops_train_blocking.out")"

fi # part 0

# ---------------------------------------------------------------- 1. selftest
if want 1; then
step selftest 600 "$NEUROCTL" selftest --device "$DEVICE"
result selftest $? "$(tail -1 "$OUT/selftest.out")"
step selftest_tf32 600 "$NEUROCTL" selftest --device "$DEVICE" --tf32
result selftest_tf32 $? "$(tail -1 "$OUT/selftest_tf32.out")"

fi # part 1

# ---------------------------------------------------------------- 2. kernels
if want 2; then
step bench_cuda 900 "$BUILD/bench/bench_cuda" --device "$DEVICE" --config "$SRC/configs/bench-large.yaml" \
    "${BENCH_CUDA_ARGS[@]}"
rc=$?
cp "$OUT/bench_cuda.out" "$OUT/bench_cuda.json"
result bench_cuda $rc
# decode with routing on the device and with NL_HOST_ROUTING=1: tokens/s of
# each, and the host synchronisations of a device-routed token (its layers
# make none; the token and position uploads are staged: only the logits'
# download waits)
$PY - "$OUT/bench_cuda.json" "$DEVICE" >"$OUT/decode_routing.txt" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1])).get("decode")
if not d:
    sys.exit("no decode figures in bench_cuda's output")
dev, host = d["device_routing"], d["host_routing"]
print("decode tok/s: device routing %.1f, host routing %.1f (x%.2f); host syncs per token %.2f vs %.2f"
      % (dev["tokens_s"], host["tokens_s"], dev["tokens_s"] / host["tokens_s"],
         dev["host_syncs_per_token"], host["host_syncs_per_token"]))
# judged on CUDA only: elsewhere the token's and position's uploads wait too
if dev["host_syncs_per_token"] > 1 and sys.argv[2].startswith("cuda:"):
    sys.exit("a device-routed decode token made more than 1 host sync")
PY
result decode_routing $? "$(tail -1 "$OUT/decode_routing.txt")"
# decode with each step replayed from a recorded CUDA graph (the default)
# against every op launched (NL_GRAPHS=0's path): tokens/s of each, the
# same greedy ids, and replays actually made
$PY - "$OUT/bench_cuda.json" >"$OUT/decode_graphs.txt" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1])).get("decode")
if not d or "no_graphs" not in d:
    sys.exit("no graph figures in bench_cuda's output")
g, n = d["device_routing"], d["no_graphs"]
print("decode tok/s: graphs %.1f, no graphs %.1f (x%.2f); %d replays in %d tokens; same ids %s"
      % (g["tokens_s"], n["tokens_s"], g["tokens_s"] / n["tokens_s"], g["graph_replays"],
         d["tokens"], d["graphs_same_ids"]))
if not d["graphs_same_ids"]:
    sys.exit("greedy ids with graphs differ from those without")
if g["graph_replays"] < d["tokens"] - 1:
    sys.exit("the decode steps were not replayed from a graph")
PY
result decode_graphs $? "$(tail -1 "$OUT/decode_graphs.txt")"
# the fused decode slots (RMSNorm + router + top-k; gate/up + SwiGLU; down +
# combine + residual) against the separate ones (NL_FUSED=0): tokens/s with
# and without graphs, op launches per token, and whether the greedy ids agree
# (FP32 either way, sums in another order: reported, not judged)
$PY - "$OUT/bench_cuda.json" >"$OUT/decode_fused.txt" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1])).get("decode")
if not d or "no_fused" not in d:
    sys.exit("no fused figures in bench_cuda's output")
f, u = d["device_routing"], d["no_fused"]
fn, un = d["no_graphs"], d["no_fused_no_graphs"]
lf, lu = d["launches_per_token"]["fused"], d["launches_per_token"]["unfused"]
print("decode tok/s fused %.1f vs unfused %.1f (x%.2f) with graphs, %.1f vs %.1f (x%.2f) without;"
      " launches per token %d vs %d; same ids %s"
      % (f["tokens_s"], u["tokens_s"], f["tokens_s"] / u["tokens_s"], fn["tokens_s"],
         un["tokens_s"], fn["tokens_s"] / un["tokens_s"], lf, lu, d["fused_same_ids"]))
if lf >= lu:
    sys.exit("the fused decode made no fewer launches than the separate slots")
PY
result decode_fused $? "$(tail -1 "$OUT/decode_fused.txt")"
# the decode KV cache in bf16 (--kv-cache bf16: half the bytes the attention
# reads per token) beside FP32, both with graphs and the fused slots:
# tokens/s and their ratio, and whether the greedy ids agree (reported, not
# judged: the cache is rounded)
$PY - "$OUT/bench_cuda.json" >"$OUT/decode_kv_bf16.txt" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1])).get("decode")
if not d or "bf16_kv_cache" not in d:
    sys.exit("no bf16 KV cache figures in bench_cuda's output")
f, h = d["device_routing"], d["bf16_kv_cache"]
print("decode tok/s bf16 KV cache %.1f vs FP32 %.1f (x%.2f); same ids %s"
      % (h["tokens_s"], f["tokens_s"], h["tokens_s"] / f["tokens_s"], d["bf16_kv_same_ids"]))
PY
result decode_kv_bf16 $? "$(tail -1 "$OUT/decode_kv_bf16.txt")"
# seeded top-p decode (temperature 0.8, top-p 0.95: generate's defaults)
# with the nucleus found on the device (only the id comes back) against
# NL_HOST_SAMPLING=1 (the logits downloaded, the host's rule): tokens/s,
# host syncs per token; the ids must agree (judged: one rule, kernels/elem.h)
$PY - "$OUT/bench_cuda.json" >"$OUT/decode_top_p.txt" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1])).get("decode")
if not d or "top_p_device" not in d:
    sys.exit("no top-p figures in bench_cuda's output")
f, h = d["top_p_device"], d["top_p_host"]
print("decode top-p 0.95 tok/s on the device %.1f (%.2f syncs/token) vs on the host %.1f "
      "(%.2f): x%.2f; greedy %.1f; same ids %s"
      % (f["tokens_s"], f["host_syncs_per_token"], h["tokens_s"], h["host_syncs_per_token"],
         f["tokens_s"] / h["tokens_s"], d["device_routing"]["tokens_s"], d["top_p_same_ids"]))
sys.exit(0 if d["top_p_same_ids"] else 1)
PY
result decode_top_p $? "$(tail -1 "$OUT/decode_top_p.txt")"
# the sample_rows slot alone (bench_cuda's "sample"): microseconds a call,
# ids back on the host, greedy / temperature 0.8 / top-p 0.95, for 1 and 16
# rows of the config's vocabulary and of 131072 ids (reported, not judged:
# what sampling adds to a token, and what the top-p search costs)
$PY - "$OUT/bench_cuda.json" >"$OUT/sample.txt" 2>&1 <<'PY'
import json, sys
s = json.load(open(sys.argv[1])).get("sample")
if not s:
    sys.exit("no sample figures in bench_cuda's output")
us = {(x["vocab"], x["rows"], x["mode"]): x["us"] for x in s}
parts = []
for v, r in sorted({(x["vocab"], x["rows"]) for x in s}):
    parts.append("V %d x %d rows: %s" % (v, r, ", ".join(
        "%s %.1f" % (m, us[(v, r, m)]) for m in ("greedy", "temperature", "top_p")
        if (v, r, m) in us)))
print("sample_rows us per call: " + "; ".join(parts))
PY
result sample $? "$(tail -1 "$OUT/sample.txt")"
# batched decode (a stage's path, core/model/batch.c: every product row
# invariant, the fused decode slots below 16 rows): 1, 4 and 16 sessions
# together, aggregate tokens/s and the speed-up over one; session 0's greedy
# ids must be the same in every batch (judged); batch-1 decode with gemm's
# decode rows on the gemm_rows kernel (the default) against cuBLAS
# (NL_CUDA_ROWS=cublas), and whether the batch's ids equal nl_forward's
# (reported: the 64-token prompt goes through cuBLAS there)
$PY - "$OUT/bench_cuda.json" >"$OUT/decode_batch.txt" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1])).get("batch_decode")
if not d:
    sys.exit("no batched decode figures in bench_cuda's output")
runs = " ".join("%d: %.1f tok/s (x%.2f, %.2f syncs/step)" % (r["sessions"], r["tokens_s"], r["x_one"],
                r["host_syncs_per_step"]) for r in d["runs"])
print("batched decode, sessions %s; same ids in every batch %s; as nl_forward's %s; batch-1 decode"
      " gemm_rows kernel %.1f vs cuBLAS %.1f tok/s (x%.2f, same ids %s)"
      % (runs, d["same_ids_every_batch"], d["same_ids_as_forward"], d["rows_kernel_tokens_s"],
         d["cublas_tokens_s"], d["rows_kernel_tokens_s"] / d["cublas_tokens_s"], d["cublas_same_ids"]))
if not d["same_ids_every_batch"]:
    sys.exit("a session's greedy ids depend on the batch around it")
PY
result decode_batch $? "$(tail -1 "$OUT/decode_batch.txt")"
# batch-1 decode against the memory bound (issue 29), on each CONFIG:PRECISION
# of DECODE_SPECS beside the run above (bench-large, FP32): bench_cuda
# --decode-only, the same split each time. Per run: tokens/s (device
# routing, recorded steps), host syncs per token, device routing against
# host routing (issue 29's target: never slower; reported), and the fraction of
# the memory-bound limit: the bytes a token reads (its weights once, in
# bf16 from their copies; the KV cache at the run's mean context) over the
# device's copy bandwidth measured in the same run
jsons=("$OUT/bench_cuda.json")
for spec in $DECODE_SPECS; do
    cfg=${spec%%:*} prec=${spec##*:}
    step "bench_cuda_${cfg}_$prec" 600 "$BUILD/bench/bench_cuda" --device "$DEVICE" \
        --config "$SRC/configs/$cfg.yaml" --precision "$prec" --decode-only "${BENCH_CUDA_ARGS[@]}"
    rc=$?
    cp "$OUT/bench_cuda_${cfg}_$prec.out" "$OUT/bench_cuda_${cfg}_$prec.json"
    result "bench_cuda_${cfg}_$prec" $rc
    jsons+=("$OUT/bench_cuda_${cfg}_$prec.json")
done
$PY - "${jsons[@]}" >"$OUT/decode_bound.txt" 2>&1 <<'PY'
import json, os, sys
bad = []
for path in sys.argv[1:]:
    try:
        j = json.load(open(path))
        d, b = j["decode"], j["decode_bound"]
    except (OSError, ValueError, KeyError) as e:
        bad.append("%s: no decode figures (%s)" % (os.path.basename(path), e))
        continue
    dev, host = d["device_routing"], d["host_routing"]
    cfg = os.path.basename(j.get("config", "?")).replace(".yaml", "")
    print("%s %s: %.1f tok/s, %.2f syncs/token, %.1f%% of the memory bound (%.1f MB/token at %.0f GB/s:"
          " %.0f tok/s; bf16 KV cache %.1f%%); device/host routing x%.2f"
          % (cfg, b["precision"], dev["tokens_s"], dev["host_syncs_per_token"], 100 * b["frac"],
             b["bytes_per_token"] / 1e6, b["copy_gbs"], b["limit_tokens_s"], 100 * b["bf16_kv_frac"],
             dev["tokens_s"] / host["tokens_s"]))
    if dev["tokens_s"] < host["tokens_s"]:
        print("  target missed: device routing slower than host routing")
for m in bad:
    print(m)
sys.exit(1 if bad else 0)
PY
result decode_bound $? "$(tr '\n' ';' <"$OUT/decode_bound.txt" | head -c 900)"
# where a decode token's time goes (the H200 run: about 0.9 ms a token on
# bench-large in FP32 and bf16 alike, far from the memory bound): the same
# decode-only run with NL_CUDA_PROFILE=1 (every slot waited for, so no
# recorded steps: each launch shows), in DECODE_PROFILE's precisions, the
# last with the batched decode of 1, 4 and 16 sessions too (16 cost 8x one
# a step on the H200); the slots' shares, the largest first, in
# decode_profile_SPEC.txt
for spec in $DECODE_PROFILE; do # PRECISION, or PRECISION-batch: with the batched decode
    prec=${spec%-batch} batch=()
    [ "$prec" != "$spec" ] && batch=(--decode-batch)
    step "decode_profile_$spec" 300 env NL_CUDA_PROFILE=1 "$BUILD/bench/bench_cuda" --device "$DEVICE" \
        --config "$SRC/configs/$DECODE_PROFILE_CONFIG.yaml" --precision "$prec" --decode-only \
        "${batch[@]}" --decode-tokens 32 "${BENCH_CUDA_ARGS[@]}"
    rc=$?
    # each backend logs its own profile when freed (the TF32 one and a batch's
    # cuBLAS comparison among them): keep the block of the most time, the
    # decode backend's (every decode mode it ran, their prompts too)
    grep -ho "NL_CUDA_PROFILE: .*\|profile .*" "$OUT/decode_profile_$spec.err" |
        awk '/^NL_CUDA_PROFILE: /{n++; t[n]=$2} n{b[n]=b[n] $0 "\n"}
             END{k=1; for (i=2; i<=n; i++) if (t[i]+0 > t[k]+0) k=i; if (n) printf "%s", b[k]}' \
            >"$OUT/decode_profile_$spec.txt"
    result "decode_profile_$spec" $rc "$(head -7 "$OUT/decode_profile_$spec.txt" | tr -s ' ' | tr '\n' ';')"
done

fi # part 2

# ---------------------------------------------------------------- 3. model benchmarks
if want 3; then
for cfg in $CONFIGS; do
    step "bench_${cfg}_cuda" 900 "$NEUROCTL" bench --device "$DEVICE" --config "$SRC/configs/$cfg.yaml"
    result "bench_${cfg}_cuda" $? "$(head -c 300 "$OUT/bench_${cfg}_cuda.out")"
    # the CPU run, for the speed-up, only on CPU_CONFIGS (the issue asks it
    # on bench-large; bench-xl on the CPU would take most of the run's time)
    if [[ " $CPU_CONFIGS " == *" $cfg "* ]]; then
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
    fi
    # the device's training figures: there once its backend can train
    $PY - "$OUT/bench_${cfg}_cuda.out" >"$OUT/train_figures_$cfg.txt" 2>&1 <<'PY'
import json, sys
j = [json.loads(l) for l in open(sys.argv[1]).read().splitlines() if l.startswith("{")]
if not j or not j[-1].get("train_tok_s"):
    sys.exit("no training figures (train_tok_s) from the device's bench run")
g = j[-1]
print("%s: train %.1f tok/s, %.1f GFLOP/s, %.3f of the SGEMM peak (%.1f GFLOP/s)" % (
    g.get("device"), g["train_tok_s"], g.get("train_gflops") or 0, g.get("train_peak_frac") or 0,
    g.get("gemm_peak_gflops") or 0))
PY
    result "bench_${cfg}_train" $? "$(tail -1 "$OUT/train_figures_$cfg.txt")"
done

fi # part 3

# ---------------------------------------------------------------- 4. mixed cluster
if want 4; then
W="$SCRATCH/mixed"
C="$W/cluster"
mkdir -p "$W"
cleanup() { "$NEUROCTL" cluster down --dir "$C" >/dev/null 2>&1; keep_logs "$C" mixed; }
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
step mixed_up 300 env NL_TEST_GFLOPS="$MIXED_GFLOPS" "$NEUROCTL" cluster up --dir "$C" --nodes 2 \
    --device "$DEVICE,cpu" --model "$W/m.safetensors" --memory 8G --timeout 240
result mixed_up $?
"$NEUROCTL" status --cluster "$C" >"$OUT/mixed_status.txt" 2>&1
check_split mixed_split "$C" "$DEVICE,cpu"
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
unset -f cleanup

fi # part 4

# ---------------------------------------------------------------- 5. training
if want 5; then
TW="$SCRATCH/train" # the model, data and checkpoints; the logs go to TL
TL="$OUT/train"
mkdir -p "$TW" "$TL"
cleanup_train() {
    local d
    for d in "$TW"/cluster-*; do
        [ -d "$d" ] || continue
        "$NEUROCTL" cluster down --dir "$d" >/dev/null 2>&1
        keep_logs "$d" "train_$(basename "$d")"
    done
}
step train_init 300 "$NEUROCTL" init --config "$SRC/configs/$TRAIN_CONFIG.yaml" --out "$TW/m.safetensors" --seed 9
result train_init $?
cp "$SRC"/tests/data/corpus.txt "$TW/data.txt" # bytes: ids below 256, valid in every config
JOB=(--data "$TW/data.txt" --steps 20 --batch 8 --seq 64 --microbatches 2 --lr 1e-3 --seed 3)
# (a) the same job twice on the device: the same bytes
for r in 1 2; do
    step "train_local_$r" 900 "$NEUROCTL" train --device "$DEVICE" --model "$TW/m.safetensors" "${JOB[@]}" \
        --log "$TL/local$r.jsonl" --out "$TW/local$r.safetensors"
    result "train_local_$r" $? "$(grep -o 'on [^ ]* (TF32 [a-z]*)' "$OUT/train_local_$r.err")"
done
cmp "$TW/local1.safetensors" "$TW/local2.safetensors" >"$OUT/train_cmp.txt" 2>&1 &&
    echo "byte-identical checkpoints ($(wc -c <"$TW/local1.safetensors") bytes)" >"$OUT/train_cmp.txt"
result train_reproducible $? "two runs on $DEVICE: $(head -1 "$OUT/train_cmp.txt")"
grep -q "\"device\":\"$DEVICE\",\"tf32\":false" "$TL/local1.jsonl" &&
    grep -q "on $DEVICE (TF32 off)" "$OUT/train_local_1.err"
result train_reported $? "device and tf32 false in the header and log"
step train_local_tf32 900 "$NEUROCTL" train --device "$DEVICE" --tf32 --model "$TW/m.safetensors" "${JOB[@]}" \
    --log "$TL/tf32.jsonl" --out "$TW/tf32.safetensors"
rc=$?
[ $rc -eq 0 ] && grep -q "\"tf32\":true" "$TL/tf32.jsonl"
rc=$?
note=$($PY - "$TL/tf32.jsonl" "$TL/local1.jsonl" 2>&1 <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
w = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b))
print("TF32 against FP32: worst relative loss difference %.3g over %d steps (not judged)" % (w, len(a)))
PY
)
result train_tf32 $rc "$note"
# (b) a cuda + cpu pipeline against a cpu + cpu one, loss for loss
for devs in "$DEVICE,cpu" "cpu,cpu"; do
    name=${devs//[:,]/-}
    step "train_up_$name" 300 env NL_TEST_GFLOPS="$MIXED_GFLOPS" "$NEUROCTL" cluster up \
        --dir "$TW/cluster-$name" --nodes 2 --device "$devs" \
        --model "$TW/m.safetensors" --memory 8G --timeout 240
    result "train_up_$name" $?
    [ "$devs" = "cpu,cpu" ] || check_split train_split "$TW/cluster-$name" "$devs"
    step "train_cluster_$name" 1200 "$NEUROCTL" train --cluster "$TW/cluster-$name" "${JOB[@]}" \
        --log "$TL/cluster-$name.jsonl" --checkpoint-every 20 --checkpoint-dir "$TW/ck-$name"
    result "train_cluster_$name" $? "$(head -1 "$OUT/train_cluster_$name.err")"
    cp "$TW/ck-$name/step-000020/manifest.json" "$TL/manifest-$name.json" 2>/dev/null
    "$NEUROCTL" cluster down --dir "$TW/cluster-$name" >/dev/null 2>&1
    keep_logs "$TW/cluster-$name" "train_cluster-$name"
done
mixed=${DEVICE//[:,]/-}-cpu
$PY - "$TL/cluster-$mixed.jsonl" "$TL/cluster-cpu-cpu.jsonl" "$TL/manifest-$mixed.json" \
    >"$OUT/train_mixed_compare.txt" 2>&1 <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
assert len(a) == len(b) == 20, (len(a), len(b))
worst = 0.0
for x, y in zip(a, b):
    e = abs(x["loss"] - y["loss"]) / abs(y["loss"])
    worst = max(worst, e)
    assert e <= 1e-4, ("step", x["step"], x["loss"], y["loss"])
m = json.load(open(sys.argv[3]))
where = ["%s tf32=%s" % (s.get("device"), s.get("tf32")) for s in m["shards"]]
print("mixed pipeline against cpu,cpu: 20 steps, worst relative loss difference %.3g (tol 1e-4); "
      "stages: %s" % (worst, ", ".join(where)))
PY
result train_mixed $? "$(tail -1 "$OUT/train_mixed_compare.txt")"
cleanup_train
unset -f cleanup_train
fi # part 5

# ---------------------------------------------------------------- 6. replicas
# one node, its stage as data-parallel replicas on two GPUs against one GPU;
# the coordinator and the node started by hand (cluster up gives one device
# to each node), as tests/test_replica_cli.sh does
if want 6; then
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
REPLICAS=${REPLICAS:-}
if [ -z "$REPLICAS" ] && [ "$gpus" -ge 2 ]; then
    REPLICAS=cuda:0,1
fi
if [ -z "$REPLICAS" ]; then
    echo "skip  replicas  skipped: $gpus GPU(s) here, two are needed (REPLICAS=cpu,cpu runs it on the CPU)" |
        tee -a "$SUMMARY"
else
RW="$SCRATCH/replicas" # the logs are copied into OUT (keep_logs)
mkdir -p "$RW"
rpids=()
cleanup_replicas() { for p in "${rpids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rpids=(); }
"$NEUROCTL" init --config "$SRC/configs/$TRAIN_CONFIG.yaml" --out "$RW/m.safetensors" --seed 9 >/dev/null
cp "$SRC"/tests/data/corpus.txt "$RW/data.txt"
for k in client node; do "$NEUROCTL" keygen --out "$RW/$k" >/dev/null; done
read -r -a rsize <<<"${REPLICA_JOB:---steps 12 --batch 16 --seq 128 --microbatches 4}"
RJOB=(--data "$RW/data.txt" "${rsize[@]}" --lr 1e-3 --seed 3)
# replicas_run NAME DEVICES: a coordinator and one node on DEVICES train RJOB
replicas_run() {
    local d="$RW/$1" i
    mkdir -p "$d/coord"
    cat "$RW/client.pub" "$RW/node.pub" >"$d/coord/authorized_keys"
    "$BUILD/coordinator/neurocoord" --listen 'tcp://127.0.0.1:*' --state-dir "$d/coord" --min-nodes 1 \
        --model "$RW/m.safetensors" --data-root "$RW" --checkpoint-root "$RW" --node-timeout-ms 30000 \
        >"$d/coord.log" 2>&1 &
    rpids+=($!)
    echo $! >"$d/coord.pid" # as cluster up writes it: --cluster checks that it runs
    cp "$RW/client.key" "$RW/client.pub" "$d/" 2>/dev/null
    for i in $(seq 1 100); do test -s "$d/coord/endpoint" && break; sleep 0.1; done
    "$BUILD/node/neuronode" join "$(cat "$d/coord/endpoint")" --key "$RW/node.key" \
        --coordinator-key "$d/coord/coordinator.pub" --name node --device "$2" --memory 8G \
        --checkpoint-root "$RW" >"$d/node.log" 2>&1 &
    rpids+=($!)
    for i in $(seq 1 300); do
        "$NEUROCTL" status --cluster "$d" --json --timeout 2 2>/dev/null | grep -q '"ready": *true' && break
        sleep 0.2
    done
    step "replicas_$1" 600 "$NEUROCTL" train --cluster "$d" "${RJOB[@]}" --log "$d/train.jsonl" \
        --checkpoint-dir "$d/ck" \
        --out "$d/out.safetensors"
    local rc=$?
    cleanup_replicas
    return $rc
}
one=${REPLICAS%%,*}
replicas_run one "$one"
result replicas_one $? "$one: $(tail -1 "$OUT/replicas_one.err")"
for r in two two_again; do
    replicas_run $r "$REPLICAS"
    result "replicas_$r" $? "$REPLICAS: $(grep -o '[0-9]* data-parallel replicas ([a-z]* all-reduce)' "$RW/$r/node.log" | head -1)"
done
cmp "$RW/two/out.safetensors" "$RW/two_again/out.safetensors" >"$OUT/replicas_cmp.txt" 2>&1 &&
    echo "byte-identical weights ($(wc -c <"$RW/two/out.safetensors") bytes)" >"$OUT/replicas_cmp.txt"
result replicas_reproducible $? "two runs on $REPLICAS: $(head -1 "$OUT/replicas_cmp.txt")"
$PY - "$RW/two/train.jsonl" "$RW/one/train.jsonl" >"$OUT/replicas_compare.txt" 2>&1 <<'PY'
import json, statistics, sys
two, one = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
assert len(two) == len(one) > 2, (len(two), len(one))
worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(two, one))
# tokens/s: the median step after the first (warm-up)
t2 = statistics.median(a["tokens_per_s"] for a in two[1:])
t1 = statistics.median(b["tokens_per_s"] for b in one[1:])
print("two replicas: %.0f tok/s, one: %.0f tok/s, ratio %.2f; worst relative loss difference %.3g "
      "(tol 1e-6)" % (t2, t1, t2 / t1, worst))
assert worst <= 1e-6, worst
PY
result replicas_speed $? "$(tail -1 "$OUT/replicas_compare.txt")"
keep_logs "$RW" replicas
fi
fi # part 6

echo "results in $OUT (summary.txt, commands.log)"
exit $failed
