#!/usr/bin/env bash
# Verification by recompute as real processes on loopback (issue 31):
#  - honest: 3 nodes, --verify-rate 1: every (stage, microbatch) of every
#    step is drawn and redone by another node from the stage's kept inputs
#    and its weights at the step's start; none is found wrong, the run's losses
#    and weights equal a run without verification bit for bit, and the
#    hop digests agree at both ends of every hop; the verifiers' counters
#    (neuroctl status, /api/status, /metrics) count every case, and a
#    stage's weights travel to its verifier once a step;
#  - one lying node (the test hook NL_TEST_LIE on node-2): a verifier and
#    an arbiter (the third node) agree against it; it is quarantined, its
#    key banned (authorized_keys), and the job resumes without it, ending
#    equal to the honest run bit for bit;
#  - a lying verifier: the arbiter sides with the stage, the verifier is
#    quarantined and banned, and the training equals the honest run;
#  - a node that lies from step 3 on, with a checkpoint every step: the
#    job rolls back past the checkpoints its lies reached to the last one
#    whose steps were all verified, redoes the steps since without it
#    (their checkpoints in .redo1 directories beside the set-aside ones)
#    and ends equal to the honest run bit for bit; lying from step 1 on, it
#    rolls back to the --model file the job began from;
#  - across device classes (node-1 on cpu, the others on cpu-devsim): the
#    cpu node's cases go to a cpu-devsim verifier, which compares the
#    tensors the stage sent with its own within the relative tolerance
#    (1e-4): an honest run passes, and a lying cpu node is convicted by a
#    cross-class verifier and arbiter.
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20

small_config "$W/cfg.yaml" 32 3 48 32
corpus_small > "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
RUN=(--data "$W/data.txt" --steps 4 --batch 8 --seq 16 --microbatches 4 --lr 3e-3 --seed 1)
last() { tail -1 "$1" | $PY -c "import json,sys; print(json.load(sys.stdin)[\"$2\"])"; }

run() { # run NAME RATE [ENV...]: a 3-node cluster (HTTP on), one training run
  # (TRAIN_EXTRA: more `neuroctl train` arguments; UP_DEV: the nodes' devices)
  local name=$1 rate=$2 extra=() dev=("${DEV[@]}"); shift 2
  [ -n "${TRAIN_EXTRA:-}" ] && read -ra extra <<< "$TRAIN_EXTRA"
  [ -n "${UP_DEV:-}" ] && dev=(--device "$UP_DEV")
  env "$@" "$N" cluster up "${dev[@]}" --dir "$W/$name" --nodes 3 --model "$W/m.safetensors" \
    --memory 64M --threads 1 --node-timeout-ms 4000 --timeout 60 --verify-rate "$rate" \
    --http 127.0.0.1:0 > "$W/$name.up" 2>&1
  check "$N" train --cluster "$W/$name" "${RUN[@]}" "${extra[@]}" --log "$W/$name.jsonl" --checkpoint-dir "$W/$name.ck" \
    --out "$W/$name.safetensors" 2> "$W/$name.err"
  check grep -q "on 3 pipeline stages" "$W/$name.err"
  # the event feed's recent history (up to a quarantine), read before the
  # cluster goes down
  $PY - "$(cat "$W/$name/coord/http")" "${WANT_EVENT:-train_step}" > "$W/$name.events" 2>&1 <<'PY'
import socket, sys, time
host, port = sys.argv[1].replace("http://", "").rstrip("/").rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=60)
s.sendall(b"GET /api/events HTTP/1.1\r\nHost: localhost\r\n\r\n")
buf, end = b"", time.time() + 60
want = ("event: " + sys.argv[2]).encode()
while want not in buf and time.time() < end:
    chunk = s.recv(65536)
    if not chunk:
        break
    buf += chunk
sys.stdout.write(buf.decode(errors="replace"))
PY
  if [ -n "${WANT_BANS:-}${WANT_METRIC:-}" ]; then # where an operator looks: the banned
    # keys, the verifiers' counters
    "$N" status --cluster "$W/$name" > "$W/$name.status" 2>&1
    $PY - "$(cat "$W/$name/coord/http")" "${WANT_METRIC:-neurollm_banned_keys 1}" \
      "${WANT_VCASES:-0}" > "$W/$name.http" 2>&1 <<'PY'
import json, sys, time, urllib.request
base = sys.argv[1].rstrip("/")
get = lambda p: urllib.request.urlopen(base + p, timeout=60).read().decode()
vcases = lambda st: sum(n.get("verify_cases", 0) for n in st["nodes"])
end = time.time() + 60  # the HTTP side polls the coordinator's status
while sys.argv[2] not in get("/metrics") and time.time() < end:
    time.sleep(0.2)
while vcases(json.loads(get("/api/status"))) < int(sys.argv[3]) and time.time() < end:
    time.sleep(0.2)
print(get("/metrics"))
st = json.loads(get("/api/status"))
print("STATUS " + json.dumps(st.get("banned_keys")))
print("VCASES %d" % vcases(st))
print("VBYTES %d" % sum(n.get("verify_bytes", 0) for n in st["nodes"]))
print("PAGE " + str('id="banned"' in get("/")))
PY
  fi
  "$N" cluster down --dir "$W/$name" > /dev/null 2>&1
  [ -n "${KEEP:-}" ] && for f in "$W/$name"/*.log; do cp "$f" "$KEEP/$name.$(basename "$f")"; done
}

# ---- honest, every microbatch verified, against no verification ----
run plain 0
WANT_METRIC="neurollm_node_verify_cases_total{" WANT_VCASES=48 run honest 1
check test "$(last "$W/honest.jsonl" verify_mismatches)" -eq 0
check test "$(last "$W/honest.jsonl" digest_mismatches)" -eq 0
check test "$(last "$W/plain.jsonl" verified)" -eq 0
# the verifiers answer while the training goes on: a step's report counts
# the answers in by then (those of the last steps may come after the last
# report; tests/test_stage_verify.c counts 204 of 204 deterministically)
v=$(last "$W/honest.jsonl" verified)
echo "honest: $v (stage, microbatch)s verified, none found wrong"
check test "$v" -ge 1
check cmp "$W/plain.safetensors" "$W/honest.safetensors"
# the verifiers' counters (the coordinator's, once the job has settled:
# every case answered): 3 stages x 4 microbatches x 4 steps, none found
# wrong, in neuroctl status, /api/status and /metrics; a stage's weights
# went to its verifier once a step, not with each of its 4 cases (the
# model's weights, all stages', are about the file's size: 4 steps of
# them and the cases' small inputs, well under twice that)
check grep -q "^verifiers: node" "$W/honest.status"
check grep -q "^VCASES 48$" "$W/honest.http"
check grep -q "^neurollm_node_verify_mismatches_total{node=\"node-1\"} 0$" "$W/honest.http"
check $PY - "$W/honest.http" "$(stat -c %s "$W/m.safetensors")" <<'PY'
import re, sys
text, size = open(sys.argv[1]).read(), int(sys.argv[2])
vbytes = int(re.search(r"^VBYTES (\d+)$", text, re.M).group(1))
cases = sum(float(v) for v in re.findall(r"^neurollm_node_verify_cases_total\{[^}]*\} (\S+)$", text, re.M))
assert cases == 48, cases
assert 4 * size * 0.5 < vbytes < 2 * 4 * size, (vbytes, size)
PY
check $PY - "$W/plain.jsonl" "$W/honest.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
assert a == b, (a, b)
PY

# ---- one lying stage (node-2, whichever stage it holds: a bit flip in
# its forward or backward outputs): a verifier and an arbiter convict it;
# it is quarantined, its key banned in authorized_keys, and the job
# resumes from its start (no checkpoint yet) on the two nodes left, ending
# with the weights of the honest run, bit for bit ----
WANT_EVENT=train_quarantine run lie-one 1 NL_TEST_LIE=bitflip:0.5:5 NL_TEST_LIE_NODE=node-2
check grep -q "computed step .* wrong: its verifier node .* and the arbiter node .* agree" \
  "$W/lie-one/coord.log"
check grep -q "quarantined, its key banned" "$W/lie-one/coord.log"
check grep -q "^# banned: convicted of computing wrong.* node  # node-2" \
  "$W/lie-one/coord/authorized_keys"
check grep -q '"event":"resumed"' "$W/lie-one.jsonl"
check grep -q "event: train_quarantine" "$W/lie-one.events"
check cmp "$W/plain.safetensors" "$W/lie-one.safetensors"

# ---- a lying verifier (node-2): the arbiter sides with the stage; the
# verifier is quarantined and banned, and the training equals the honest
# run ----
run lie-verifier 1 NL_TEST_LIE=verifier:1:5 NL_TEST_LIE_NODE=node-2
check grep -q "verifier node .* was wrong about step" "$W/lie-verifier/coord.log"
check grep -q "^# banned: convicted of verifying wrong.* node  # node-2" \
  "$W/lie-verifier/coord/authorized_keys"
check cmp "$W/plain.safetensors" "$W/lie-verifier.safetensors"

# ---- a stage that withholds its cases (node-2): convicted at the next
# step's reports, banned, and the job ends as the honest run ----
run lie-mute 1 NL_TEST_LIE=mute:1 NL_TEST_LIE_NODE=node-2
check grep -q "did not hand over step .* for verification" "$W/lie-mute/coord.log"
check grep -q "^# banned: convicted of computing wrong.*withheld its case.* node  # node-2" \
  "$W/lie-mute/coord/authorized_keys"
check cmp "$W/plain.safetensors" "$W/lie-mute.safetensors"

# ---- a node (node-2) that lies from step 3 on, every output, with a
# checkpoint after every step, and each case held a step before it goes
# to its verifier (the test hook NL_TEST_VERIFY_LAG=1 of neurocoord), so
# that the conviction comes after the checkpoint of step 3 holds its lies:
# the job rolls back to the last checkpoint whose steps were all verified
# (before step 3), setting the later ones aside, redoes the steps since on
# the two nodes left, writing their checkpoints to .redo1 directories, and
# ends with the weights of the honest run. The job's end waits for the
# verifications under way, so the conviction comes before it ends ----
WANT_BANS=1 TRAIN_EXTRA="--checkpoint-every 1" run lie-late 1 NL_TEST_LIE=bitflip:1:5:3 NL_TEST_LIE_NODE=node-2 \
  NL_TEST_VERIFY_LAG=1
check grep -q "computed step [3-9] .* wrong: its verifier node .* and the arbiter node .* agree" \
  "$W/lie-late/coord.log"
check grep -q "^# banned: convicted of computing wrong.* node  # node-2" \
  "$W/lie-late/coord/authorized_keys"
check grep -q "rolling back to step [0-2] " "$W/lie-late/coord.log"
check $PY - "$W/lie-late.jsonl" <<'PY'
import json, sys
rb = [r for r in map(json.loads, open(sys.argv[1])) if r.get("event") == "rollback"]
assert len(rb) == 1, rb
r = rb[0]
assert r["to_step"] < 3 <= r["from_step"], r
# the checkpoint of step 3, made before the conviction, is set aside
assert any(p.endswith("/step-000003/manifest.json") for p in r["unverified"]), r
PY
check test -f "$W/lie-late.ck/step-000004.redo1/manifest.json"
check cmp "$W/plain.safetensors" "$W/lie-late.safetensors"
# the banned key in neuroctl status (the operator's key is an admin's:
# the key and why), /metrics, /api/status (the dashboard's #banned)
key=$(sed -n 's/^# banned: .*: \([^ ]\{40\}\) node  # node-2$/\1/p' "$W/lie-late/coord/authorized_keys")
check test -n "$key"
check grep -q "^banned keys: 1$" "$W/lie-late.status"
check grep -qF "  $key  convicted of computing wrong" "$W/lie-late.status"
check grep -q "^neurollm_banned_keys 1$" "$W/lie-late.http"
check grep -qF "neurollm_banned_key{key=\"$key\"} 1" "$W/lie-late.http"
check grep -q "^STATUS 1$" "$W/lie-late.http"
check grep -q "^PAGE True$" "$W/lie-late.http"

# ---- the same from step 1 on: no checkpoint of the job is all-verified,
# so it rolls back to what it began from (the --model file, at step 0),
# setting the checkpoint of step 1 aside, and ends as the honest run ----
TRAIN_EXTRA="--checkpoint-every 1" run lie-first 1 NL_TEST_LIE=bitflip:1:5:1 NL_TEST_LIE_NODE=node-2 \
  NL_TEST_VERIFY_LAG=1
check grep -q "rolling back to step 0 (.*/m.safetensors)" "$W/lie-first/coord.log"
check test -f "$W/lie-first.ck/step-000001.redo1/manifest.json"
check cmp "$W/plain.safetensors" "$W/lie-first.safetensors"

# ---- across device classes: node-1 alone on cpu, so its stage's cases
# go to cpu-devsim nodes, which compare the ACTIVATION and GRADIENT it
# sent (kept: JOB_SUBMIT verify_outputs) with their own within 1e-4
# relative; an honest run passes and ends as the cpu-only one ----
UP_DEV=cpu,cpu-devsim,cpu-devsim run cross 1
check grep -q "across device classes: .* the stage's outputs stand" "$W/cross/node-2.log" \
  "$W/cross/node-3.log"
check test "$(last "$W/cross.jsonl" verify_mismatches)" -eq 0
check cmp "$W/plain.safetensors" "$W/cross.safetensors"
# ---- and a lying cpu node: its cross-class verifier and arbiter find
# its outputs beyond the tolerance and convict it ----
UP_DEV=cpu,cpu-devsim,cpu-devsim run cross-lie 1 NL_TEST_LIE=bitflip:1:5 NL_TEST_LIE_NODE=node-1
check grep -q "across device classes: .* the stage is wrong" "$W/cross-lie/node-2.log" \
  "$W/cross-lie/node-3.log"
check grep -q "computed step .* wrong: its verifier node .* and the arbiter node .* agree" \
  "$W/cross-lie/coord.log"
check grep -q "^# banned: convicted of computing wrong.* node  # node-1" \
  "$W/cross-lie/coord/authorized_keys"
check cmp "$W/plain.safetensors" "$W/cross-lie.safetensors"

echo "test_cluster_verify: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
