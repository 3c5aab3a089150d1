#!/usr/bin/env bash
# neuroctl train against a coordinator, without a cluster: a scripted
# coordinator (tests/fake_coord.c) plays the training job's messages.
#  - the JOB_SUBMIT: kind train, no frames, every parameter, absolute
#    paths, the checkpoint directory created;
#  - the same values give the same log records, byte for byte, and the
#    same progress lines as local training (the local run's own log is
#    played back as step events), with the start, checkpoint and
#    informational lines; --out joins the final manifest's shards;
#  - a failed job: "job N failed: MESSAGE" as the coordinator wrote it,
#    exit 1; a refused submit; --out without a final manifest;
#  - Ctrl-C sends JOB_CANCEL once and exits 130; --timeout gives up.
set -uo pipefail
N="$NL_BUILD_DIR/cli/neuroctl"
# the device of the local tools and the nodes (scripts/test.sh runs the suite
# once more with NL_TEST_DEVICE=cpu-devsim)
DEV=(--device "${NL_TEST_DEVICE:-cpu}")
FAKE="$NL_BUILD_DIR/tests/fake_coord"
W=$(mktemp -d)
fake_pid=
cleanup() {
  [ -n "$fake_pid" ] && kill "$fake_pid" 2>/dev/null
  rm -rf "$W"
}
trap cleanup EXIT
pass=0
fail=0
check() { if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $*" >&2; fi; }
EP="ipc://$W/coord.sock"

# start_fake NAME: play $W/NAME.script; the coordinator reports to $W/NAME.sent
start_fake() {
  rm -f "$W/coord.sock"
  "$FAKE" "$EP" "$W/$1.script" "$W/$1.sent" 2> "$W/$1.fake.err" &
  fake_pid=$!
  for _ in $(seq 1 600); do [ -S "$W/coord.sock" ] && return; sleep 0.1; done
}
stop_fake() {
  wait "$fake_pid"
  local rc=$?
  fake_pid=
  return $rc
}
remote=(--coordinator "$EP" --plaintext)
# progress lines without the timings
steps_of() { grep '^step ' "$1" | sed -E 's/ \| [0-9.]+ tok\/s//; s/ \| eta [^ |]*//'; }

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
"$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 3 2>/dev/null
for i in $(seq 1 100); do echo "the quick brown fox $i jumps over the lazy dog"; done > "$W/data.txt"

# a local run to play back: a skipped step (the test hook) and evaluations
opts=(--steps 6 --batch 2 --seq 16 --microbatches 2 --lr 1e-3 --seed 5 --eval-every 3)
NL_TEST_INJECT_NAN_STEP=1 "$N" train "${DEV[@]}" --model "$W/m.safetensors" --data "$W/data.txt" "${opts[@]}" \
  --threads 2 --log "$W/local.jsonl" --out "$W/local.safetensors" 2> "$W/local.err"
check test "$(wc -l < "$W/local.jsonl")" -eq 6
# its final checkpoint as a 2-stage cluster writes it: shards and a manifest
mkdir -p "$W/final"
check "$NL_BUILD_DIR/tests/make_shards" "$W/local.safetensors" "$W/final" 1 >/dev/null

# 1. a whole job
{
  echo "status running running"
  echo 'event running {"event":"start","start_step":0,"steps":6,"params":59808,"tokens":4000,"held_out":400,"stages":3,"batch":2,"seq":16,"microbatches":2}'
  n=0
  while read -r rec; do
    n=$((n + 1))
    rec=$(sed -E 's/:-?nan/:null/g' <<< "$rec") # JSON has no NaN: a coordinator sends null
    echo "event running {\"event\":\"step\",${rec#\{}"
    [ $n -eq 3 ] && echo "event running {\"event\":\"checkpoint\",\"step\":3,\"manifest\":\"$W/ck/step-000003/manifest.json\"}"
    [ $n -eq 4 ] && echo "status running node 2 is slow"
  done < "$W/local.jsonl"
  echo "event done {\"event\":\"done\",\"step\":6,\"manifest\":\"$W/final/manifest.json\"}"
} > "$W/job.script"
start_fake job
(cd "$W" && "$N" train "${remote[@]}" --data data.txt "${opts[@]}" --checkpoint-every 3 \
  --checkpoint-dir ck --log "$W/remote.jsonl" --out "$W/remote.safetensors" 2> "$W/remote.err")
check test $? -eq 0
check stop_fake
check cmp "$W/local.jsonl" "$W/remote.jsonl"
check diff <(steps_of "$W/local.err") <(steps_of "$W/remote.err")
check grep -qx "step 2: non-finite gradient; step skipped, weights unchanged" "$W/remote.err"
check grep -qx "1 step(s) skipped for non-finite values" "$W/remote.err"
check grep -qx "training 59808 parameters on 4000 tokens (400 held out): 6 steps of 2 x 16 in 2 microbatches on 3 pipeline stages" "$W/remote.err"
check grep -qx "checkpoint $W/ck/step-000003/manifest.json" "$W/remote.err"
check grep -qx "node 2 is slow" "$W/remote.err"
check cmp "$W/local.safetensors" "$W/remote.safetensors" # --out: the shards joined
check grep -qx "wrote $W/remote.safetensors" "$W/remote.err"
check test "$(grep -c running "$W/remote.err")" -eq 0
check grep -q "resuming" "$W/remote.err" --invert-match
check test -d "$W/ck"
sent="$W/job.sent"
for kv in "kind 2" "frames 0" "data=$W/data.txt" steps=6 batch=2 seq=16 microbatches=2 lr=0.001 \
  min_lr=0.0001 warmup=0 seed=5 holdout=0.1 eval_every=3 eval_batches=4 checkpoint_every=3 \
  "checkpoint_dir=$W/ck" recompute=false final_checkpoint=true; do
  check grep -qxF "$kv" "$sent"
done
check test "$(grep -c '^resume=' "$sent")" -eq 0

# 2. resume: the log is appended to, the manifest's directory is sent
mkdir -p "$W/ck/step-000003"
echo "{}" > "$W/ck/step-000003/manifest.json"
{
  echo "status running running"
  echo 'event running {"event":"start","start_step":3,"steps":6,"params":59808,"tokens":4000,"held_out":400,"stages":3,"batch":2,"seq":16,"microbatches":2}'
  echo 'event running {"event":"step","step":4,"loss":null,"ce_loss":null,"aux_loss":1,"lr":0.0001,"grad_norm":0,"tokens_per_s":10,"skipped":true}'
  echo 'event done {"event":"done","step":4}'
} > "$W/resume.script"
echo "earlier" > "$W/resume.jsonl"
start_fake resume
"$N" train "${remote[@]}" --data "$W/data.txt" --steps 6 --resume "$W/ck/step-000003/" \
  --log "$W/resume.jsonl" 2> "$W/resume.err"
check test $? -eq 0
check stop_fake
check grep -qx "resume=$W/ck/step-000003" "$W/resume.sent"
check grep -qx "final_checkpoint=true" "$W/resume.sent"
check grep -qx "resuming at step 3" "$W/resume.err"
check grep -qx "step 4: non-finite loss; step skipped, weights unchanged" "$W/resume.err"
check test "$(head -1 "$W/resume.jsonl")" = "earlier"
check grep -q '"step":4,.*"skipped":true' "$W/resume.jsonl"

# 3. a failed job: the coordinator's message as it is, exit 1
msg="node 2 (tcp://10.0.0.2:7001) stopped answering at step 5; last checkpoint $W/ck/step-000003/manifest.json"
printf 'job 12\nstatus running running\nstatus failed %s\n' "$msg" > "$W/failed.script"
start_fake failed
"$N" train "${remote[@]}" --data "$W/data.txt" --steps 6 2> "$W/failed.err"
check test $? -eq 1
check stop_fake
check grep -qxF "neuroctl train: job 12 failed: $msg" "$W/failed.err"

# 4. a refused submit (job 0)
printf 'job 0\nstatus failed the cluster is not ready: 1 node of 3\n' > "$W/refused.script"
start_fake refused
"$N" train "${remote[@]}" --data "$W/data.txt" --steps 6 2> "$W/refused.err"
check test $? -eq 1
check stop_fake
check grep -qF "refused the job: the cluster is not ready" "$W/refused.err"

# 5. --out, but the job ends without a final manifest
printf 'status running running\nevent done {"event":"done","step":6}\n' > "$W/noout.script"
start_fake noout
"$N" train "${remote[@]}" --data "$W/data.txt" --steps 6 --out "$W/final.safetensors" \
  --checkpoint-dir "$W/ck5" 2> "$W/noout.err"
check test $? -eq 1
check stop_fake
check grep -q "without a final checkpoint" "$W/noout.err"
check grep -qx "final_checkpoint=true" "$W/noout.sent"

# 6. Ctrl-C: one JOB_CANCEL, the job's end, exit 130
{
  echo "status running running"
  echo 'event running {"event":"start","start_step":0,"steps":6,"params":1,"tokens":1,"held_out":0,"stages":1,"batch":2,"seq":16,"microbatches":1}'
  echo 'event running {"event":"step","step":1,"loss":5,"ce_loss":5,"aux_loss":1,"lr":0.0001,"grad_norm":1,"tokens_per_s":10,"skipped":false}'
  echo "wait_cancel"
  echo "status cancelled cancelled by the client at step 1"
} > "$W/cancel.script"
start_fake cancel
"$N" train "${remote[@]}" --data "$W/data.txt" --steps 6 --log "$W/cancel.jsonl" 2> "$W/cancel.err" &
client=$!
for _ in $(seq 1 1200); do [ -s "$W/cancel.jsonl" ] && break; sleep 0.05; done
kill -INT $client
wait $client
check test $? -eq 130
check stop_fake
check test "$(grep -c '^cancel 7$' "$W/cancel.sent")" -eq 1
check grep -q "job 7 was cancelled: cancelled by the client" "$W/cancel.err"

# 7. --timeout: no message for that long gives a clear error
printf 'status running running\nsleep 2500\n' > "$W/quiet.script"
start_fake quiet
t0=$(date +%s.%N)
"$N" train "${remote[@]}" --data "$W/data.txt" --steps 6 --timeout 1 2> "$W/quiet.err"
check test $? -eq 1
# at the 1 s, not after the fake's 2500 s (the bound leaves room for a
# sanitizer build's start and exit on a busy machine)
check awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { exit !(b - a <= 10.0) }'
check grep -q "no message from the coordinator in 1 s" "$W/quiet.err"
check stop_fake

echo "test_remote_train: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
