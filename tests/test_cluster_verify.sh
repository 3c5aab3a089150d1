#!/usr/bin/env bash
# Verification by recompute as real processes on loopback (issue 31):
#  - honest: 3 nodes, --verify-rate 1: every (stage, microbatch) of every
#    step is drawn and redone by another node from the stage's kept inputs
#    and its weights at the step's start; none is found wrong, the run's losses
#    and weights equal a run without verification bit for bit, and the
#    hop digests agree at both ends of every hop;
#  - lying: the same with every node lying on half its outputs in one way
#    (the test hook NL_TEST_LIE; the recompute itself is honest): the
#    coordinator finds mismatches and names the stage and node;
#  - one lying node: a verifier and an arbiter (the third node) agree
#    against it; a lying verifier: the arbiter sides with the stage, and
#    the training (honest) equals the run without verification.
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20

small_config "$W/cfg.yaml" 32 3 48 32
cat "$NL_SOURCE_DIR"/README.md > "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
RUN=(--data "$W/data.txt" --steps 4 --batch 8 --seq 16 --microbatches 4 --lr 3e-3 --seed 1)
last() { tail -1 "$1" | $PY -c "import json,sys; print(json.load(sys.stdin)[\"$2\"])"; }

run() { # run NAME RATE [ENV...]: a 3-node cluster, one training run
  local name=$1 rate=$2; shift 2
  env "$@" "$N" cluster up "${DEV[@]}" --dir "$W/$name" --nodes 3 --model "$W/m.safetensors" \
    --memory 64M --threads 1 --node-timeout-ms 4000 --timeout 60 --verify-rate "$rate" \
    > "$W/$name.up" 2>&1
  check "$N" train --cluster "$W/$name" "${RUN[@]}" --log "$W/$name.jsonl" --checkpoint-dir "$W/$name.ck" \
    --out "$W/$name.safetensors" 2> "$W/$name.err"
  check grep -q "on 3 pipeline stages" "$W/$name.err"
  "$N" cluster down --dir "$W/$name" > /dev/null 2>&1
  [ -n "${KEEP:-}" ] && for f in "$W/$name"/*.log; do cp "$f" "$KEEP/$name.$(basename "$f")"; done
}

# ---- honest, every microbatch verified, against no verification ----
run plain 0
run honest 1
check test "$(last "$W/honest.jsonl" verify_mismatches)" -eq 0
check test "$(last "$W/honest.jsonl" digest_mismatches)" -eq 0
check test "$(last "$W/plain.jsonl" verified)" -eq 0
# the verifiers answer while the training goes on: a step's report counts
# the answers in by then (those of the last steps may come after the last
# report; tests/test_stage_train.c counts 204 of 204 deterministically)
v=$(last "$W/honest.jsonl" verified)
echo "honest: $v (stage, microbatch)s verified, none found wrong"
check test "$v" -ge 1
check cmp "$W/plain.safetensors" "$W/honest.safetensors"
check $PY - "$W/plain.jsonl" "$W/honest.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
assert a == b, (a, b)
PY

# ---- every node lies on half its outputs: caught ----
for kind in bitflip backward; do
  run "lie-$kind" 1 NL_TEST_LIE="$kind:0.5:3"
  m=$(last "$W/lie-$kind.jsonl" verify_mismatches)
  echo "lie $kind: $m mismatches of $(last "$W/lie-$kind.jsonl" verified) verified"
  check test "$m" -gt 0
  check grep -q "recompute gives another" "$W/lie-$kind/coord.log"
done

# ---- one lying stage (node-2, whichever stage it holds): a verifier and
# an arbiter convict it ----
run lie-one 1 NL_TEST_LIE=bitflip:0.5:5 NL_TEST_LIE_NODE=node-2 # any stage's outputs
echo "lie-one: convicted $(last "$W/lie-one.jsonl" verify_convicted), outvoted $(last "$W/lie-one.jsonl" verify_outvoted)"
check test "$(last "$W/lie-one.jsonl" verify_convicted)" -gt 0
check test "$(last "$W/lie-one.jsonl" verify_outvoted)" -eq 0
check grep -q "computed step .* wrong: its verifier node .* and the arbiter node .* agree" \
  "$W/lie-one/coord.log"

# ---- a lying verifier (node-2): the arbiter sides with the stage ----
run lie-verifier 1 NL_TEST_LIE=verifier:1:5 NL_TEST_LIE_NODE=node-2
echo "lie-verifier: convicted $(last "$W/lie-verifier.jsonl" verify_convicted), outvoted $(last "$W/lie-verifier.jsonl" verify_outvoted)"
check test "$(last "$W/lie-verifier.jsonl" verify_outvoted)" -gt 0
check test "$(last "$W/lie-verifier.jsonl" verify_convicted)" -eq 0
check cmp "$W/plain.safetensors" "$W/lie-verifier.safetensors"

echo "test_cluster_verify: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
