#!/usr/bin/env bash
# Issue 31 benchmark: what verification by recompute costs and buys.
#   overhead   4 nodes on loopback (1 thread each), the same training run
#              with --verify-rate 0 and at the default (0.05), REPS times
#              each, interleaved; the figure per run is the median of the
#              per-step tokens/s in the JSONL log, steps 3 and later;
#              ratio = default / off (target >= 0.95); and the same of
#              each run's throughput, the harmonic mean of those steps'
#              tokens/s (their tokens over their time: a drawn (stage,
#              step) costs in a few steps, which the median may not see)
#   catch      every node lying on a fraction Q (default 0.01) of its
#              outputs (NL_TEST_LIE=bitflip:Q:SEED; needs a test build,
#              -DNL_TEST_HOOKS=ON), at the default rate: the first step
#              whose report counts a mismatch (or the step a conviction's
#              rollback left, whichever comes first), for SEEDS seeds, against
#              the formula of docs/security.md for S lying stages (a
#              drawn (stage, step) checks all M of its microbatches):
#              P(caught within k steps) = 1 - (1 - P (1 - (1 - Q)^M))^(S k)
# Model: d 256, 8 layers, 8 heads (2 kv), 4 experts of 256, byte
# vocabulary: every stage's weights fit a verifier's control socket
# (16 MiB a part; bench-small's stages do not: docs/security.md, "Limit").
# Prints JSON.
#   bench/bench_verify.sh [BUILD_DIR] [STEPS]       defaults: build 12
#   env: REPS (2), Q (0.01), SEEDS (3), CATCH_STEPS (120), M (8), UP_EXTRA (more
#   `cluster up` arguments: "--replicas 2" for 2 stages x 2 replicas, whose
#   cases go to the stage's other replica; "--wire bf16" for the bf16 wire)
set -euo pipefail
B=${1:-build}
STEPS=${2:-12}
REPS=${REPS:-2}
Q=${Q:-0.01}
SEEDS=${SEEDS:-3}
CATCH_STEPS=${CATCH_STEPS:-120}
M=${M:-8}
N=$B/cli/neuroctl
W=$(mktemp -d)
trap 'for c in "$W"/c*; do "$N" cluster down --dir "$c" >/dev/null 2>&1 || true; done; rm -rf "$W"' EXIT
cat > "$W/cfg.yaml" <<'YAML'
hidden_dim: 256
num_layers: 8
num_heads: 8
num_kv_heads: 2
ffn_dim: 256
num_experts: 4
vocab_size: 256
vocab_chunk: 256
max_seq_len: 256
YAML
cp tests/data/corpus.txt "$W/data.txt"
"$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7 >/dev/null
export NL_TEST_GFLOPS=20 # equal probes: the same 4-stage plan every run

read -ra UP <<< "${UP_EXTRA:-}"
run() { # run NAME RATE STEPS [ENV...]: prints nothing; the log is $W/NAME.jsonl
  local name=$1 rate=$2 steps=$3; shift 3
  env "$@" "$N" cluster up --dir "$W/c-$name" --nodes 4 --model "$W/m.safetensors" --memory 512M \
    --threads 1 --verify-rate "$rate" --timeout 120 ${UP[@]+"${UP[@]}"} >/dev/null 2>&1
  "$N" train --cluster "$W/c-$name" --data "$W/data.txt" --steps "$steps" --batch 16 --seq 64 \
    --microbatches "$M" --lr 1e-3 --seed 1 --log "$W/$name.jsonl" \
    --checkpoint-dir "$W/ck-$name" >/dev/null 2>&1 || true
  "$N" cluster down --dir "$W/c-$name" >/dev/null 2>&1 || true
}

for r in $(seq 1 "$REPS"); do
  run "off-$r" 0 "$STEPS"
  run "on-$r" 0.05 "$STEPS"
done
for s in $(seq 1 "$SEEDS"); do
  run "lie-$s" 0.05 "$CATCH_STEPS" NL_TEST_LIE="bitflip:$Q:$s"
done

python3 - "$W" "$REPS" "$SEEDS" "$Q" "$M" <<'PY'
import json, math, statistics, sys
w, reps, seeds, q, M = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
P, S = 0.05, 4  # S: the lying nodes (with replicas, each its stage's microbatches' share)
def log(name):
    try:
        return [json.loads(l) for l in open("%s/%s.jsonl" % (w, name))]
    except OSError:
        return []
def tps(name, mean=statistics.median):
    v = [r["tokens_per_s"] for r in log(name) if r.get("step", 0) >= 3 and "tokens_per_s" in r]
    return mean(v) if v else None
off = [tps("off-%d" % r) for r in range(1, reps + 1)]
on = [tps("on-%d" % r) for r in range(1, reps + 1)]
hm = statistics.harmonic_mean
off_t = [tps("off-%d" % r, hm) for r in range(1, reps + 1)]
on_t = [tps("on-%d" % r, hm) for r in range(1, reps + 1)]
ok_t = [x for x in off_t if x] and [x for x in on_t if x]
ver = [log("on-%d" % r)[-1].get("verified") if log("on-%d" % r) else None for r in range(1, reps + 1)]
def caught(name):  # the step by which the job knew: a report that counts a mismatch, or the
    # step a conviction's rollback left (the report of the step it came in may not count it)
    for r in log(name):
        if r.get("event") == "rollback":
            return r.get("from_step")
        if r.get("verify_mismatches", 0) > 0 and "step" in r:
            return r["step"]
    return None
catch = [caught("lie-%d" % s) for s in range(1, seeds + 1)]
p1 = P * (1 - (1 - q) ** M)  # a liar stage caught in one step: drawn, and a lie among its M
steps99 = math.log(0.01) / (S * math.log(1 - p1))  # S liar stages
ok = [x for x in off if x] and [x for x in on if x]
print(json.dumps({
    "tokens_per_s_off": off, "tokens_per_s_default": on, "verified_default": ver,
    "ratio": (statistics.median([x for x in on if x]) / statistics.median([x for x in off if x])) if ok else None,
    "throughput_off": [round(x) if x else None for x in off_t],
    "throughput_default": [round(x) if x else None for x in on_t],
    "ratio_throughput": (statistics.median([x for x in on_t if x]) /
                         statistics.median([x for x in off_t if x])) if ok_t else None,
    "catch_q": q, "catch_first_step": catch, "microbatches_per_step": M,
    "formula_microbatches_99pct": math.ceil(steps99 * M), "formula_steps_99pct": math.ceil(steps99),
    "formula_expected_steps": round(1 / (1 - (1 - p1) ** S), 1)}, indent=1))
PY
