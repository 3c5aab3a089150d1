#!/usr/bin/env bash
# Verification by recompute with stage replicas on different nodes
# (neurocoord --replicas 2: microbatch i on replica i mod 2) and with the
# bf16 wire (neurocoord --wire bf16), as real processes on loopback
# (issue 31; test_cluster_verify.sh covers one pipeline on the FP32 wire):
#  - honest, 2 stages x 2 replicas, --verify-rate 1: every (stage,
#    microbatch) of every step is drawn, each case from the replica that
#    ran it (every replica reports the digests of its microbatches), redone
#    by the stage's other replica or another node; none is found wrong, and
#    the weights equal a run without verification byte for byte;
#  - a lying node in that job: convicted by a verifier and an arbiter,
#    banned, and the job resumes without it (3 nodes: one stage on 2
#    replicas), ending with the honest run's weights byte for byte;
#  - the same two with --wire bf16 on 5 nodes (2 x 2 and a standby that
#    joins after them, so that the 4 left after the ban plan 2 x 2 again
#    and the hops are rounded as in the honest run): the cases carry the bf16 bytes that
#    crossed the wire, the verifier rounds its outputs to bf16, and the
#    digests agree bit for bit for an honest stage.
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20

small_config "$W/cfg.yaml" 32 3 48 32
corpus_small > "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
RUN=(--data "$W/data.txt" --steps 4 --batch 8 --seq 16 --microbatches 4 --lr 3e-3 --seed 1)
last() { tail -1 "$1" | $PY -c "import json,sys; print(json.load(sys.stdin)[\"$2\"])"; }

run() { # run NAME NODES RATE [ENV...]: a cluster of NODES with --replicas 2 (or REPLICAS)
  # of MODEL (default m; UP_EXTRA: more `cluster up` arguments), one training run
  local name=$1 nodes=$2 rate=$3 extra=(); shift 3
  [ -n "${UP_EXTRA:-}" ] && read -ra extra <<< "$UP_EXTRA"
  env "$@" "$N" cluster up "${DEV[@]}" --dir "$W/$name" --nodes "$nodes" --replicas "${REPLICAS:-2}" \
    --model "$W/${MODEL:-m}.safetensors" --memory 64M --threads 1 --node-timeout-ms 4000 --timeout 60 \
    --verify-rate "$rate" "${extra[@]}" > "$W/$name.up" 2>&1
  [ -n "${STANDBY:-}" ] && late_standby "$name"
  check "$N" train --cluster "$W/$name" "${RUN[@]}" --log "$W/$name.jsonl" \
    --checkpoint-dir "$W/$name.ck" --out "$W/$name.safetensors" 2> "$W/$name.err"
  check grep -q "replicas on" "$W/$name/coord.log"
  "$N" cluster down --dir "$W/$name" > /dev/null 2>&1
  [ -n "${KEEP:-}" ] && for f in "$W/$name"/*.log; do cp "$f" "$KEEP/$name.$(basename "$f")"; done
}

late_standby() { # late_standby NAME: a fifth node joins cluster NAME after its 4 are
  # planned, so that it, and not one of them, is the plan's standby (with 5
  # nodes from `cluster up` the one that joined last was the standby: on a
  # loaded machine node-2, the liar, which then never computed)
  local c="$W/$1" i
  "$N" keygen --out "$W/$1-standby" > /dev/null
  echo "$(cat "$W/$1-standby.pub") node  # standby" >> "$c/coord/authorized_keys"
  check reload_keys "$c"
  "$NODE" join "${DEV[@]}" "$(cat "$c/coord/endpoint")" --key "$W/$1-standby.key" \
    --coordinator-key "$c/coord/coordinator.pub" --memory 64M --threads 1 --name standby \
    --checkpoint-root / > "$c/standby.log" 2>&1 &
  for i in $(seq 1 600); do # the plan at rest weighed with it, and kept
    grep -q "re-plan at rest: the plan stays .*; 5 nodes would give" "$c/coord.log" && break
    sleep 0.1
  done
  check grep -q "re-plan at rest: the plan stays .*; 5 nodes would give" "$c/coord.log"
}

honest() { # honest NAME PLAIN: no accusation, every hop's digests agree, PLAIN's weights
  check test "$(last "$W/$1.jsonl" verify_mismatches)" -eq 0
  check test "$(last "$W/$1.jsonl" digest_mismatches)" -eq 0
  check test "$(last "$W/$1.jsonl" verify_convicted)" -eq 0
  check cmp "$W/$2.safetensors" "$W/$1.safetensors"
  # every (stage, microbatch) of the 4 steps was drawn from the replica that
  # ran it (2 stages x 4 microbatches a step, half of them replica 1's) and
  # answered clean by the job's end
  check grep -q "train job 1: 32 (stage, microbatch)s drawn for verification, 32 answered, 0 found wrong, 0 skipped" \
    "$W/$1/coord.log"
  check test "$(grep -c "not verified" "$W/$1/coord.log")" -eq 0
}

convicted() { # convicted NAME PLAIN: the liar (node-2) banned, PLAIN's weights
  check grep -q "computed step .* wrong: its verifier node .* and the arbiter node .* agree" \
    "$W/$1/coord.log"
  check grep -q "^# banned: convicted of computing wrong.* node  # node-2" \
    "$W/$1/coord/authorized_keys"
  check grep -q '"event":"resumed"' "$W/$1.jsonl"
  check cmp "$W/$2.safetensors" "$W/$1.safetensors"
}

# ---- 2 stages x 2 replicas, the FP32 wire ----
run plain 4 0
run honest 4 1
honest honest plain
run lie 4 1 NL_TEST_LIE=bitflip:0.5:5 NL_TEST_LIE_NODE=node-2
convicted lie plain

# ---- the same on the bf16 wire: 2 x 2 and a standby. Slow nodes (by
# the test hook) keep the training plan of the 4 left after the ban on 2
# stages (on fast ones a stage's compute is below a hop's cost and the
# planner takes one stage, whose run crosses no wire), and no early
# re-balance moves the plan of one run and not the other's. The plan is
# held whatever speeds the coordinator observed before the re-plan (under
# ASan on a loaded machine the lie's run once ended with other weights):
# 2 stages of 2 replicas each (--replicas 2,2), and a model of 2 layers,
# whose 2 stages have one split ----
small_config "$W/cfg2.yaml" 32 2 48 32
check "$N" init --config "$W/cfg2.yaml" --out "$W/m2.safetensors" --seed 7
export NL_TEST_GFLOPS=0.05 MODEL=m2 REPLICAS=2,2
export STANDBY=1
UP_EXTRA="--rebalance-after 0" run plain32 4 0
UP_EXTRA="--wire bf16 --rebalance-after 0" run plain16 4 0
check bash -c "! cmp -s '$W/plain32.safetensors' '$W/plain16.safetensors'" # the wire rounds
UP_EXTRA="--wire bf16 --rebalance-after 0" run honest16 4 1
honest honest16 plain16
UP_EXTRA="--wire bf16 --rebalance-after 0" run lie16 4 1 NL_TEST_LIE=bitflip:0.5:5 NL_TEST_LIE_NODE=node-2
convicted lie16 plain16

echo "test_cluster_verify_lanes: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
