# Sourced by the shell tests that start local clusters: the tools, the
# device, a scratch directory that is cleaned up with every cluster in it,
# the pass/fail counters, the wait for a training log's step (wait_step),
# for a re-plan after a death (wait_replanned), for the coordinator to take
# keys added to its authorized_keys (reload_keys), a tokens file for
# forward (tokens_file), and the small model configs they train.
#   N (neuroctl), NODE (neuronode), COORD (neurocoord), PY, DEV (the
#   --device of the local tools and the nodes: scripts/test.sh runs the
#   suite once more with NL_TEST_DEVICE=cpu-devsim), W (scratch), check CMD...
# A test that starts processes of its own defines test_cleanup; it runs
# first at exit, after the logs' digest of a test with a failed check
# (failure_digest). Clusters go down with `cluster down` (every directory
# under W that has a coord.pid), then anything still naming W is killed.
set -uo pipefail
N="$NL_BUILD_DIR/cli/neuroctl"
NODE="$NL_BUILD_DIR/node/neuronode"
COORD="$NL_BUILD_DIR/coordinator/neurocoord"
PY=/usr/bin/python3
DEV=(--device "${NL_TEST_DEVICE:-cpu}")
W=$(mktemp -d)
# the training text: the project's README and docs of 2026-11-27, frozen,
# so that editing the docs changes no test's numbers; corpus_small: its
# first 32340 bytes (that README)
CORPUS="$NL_SOURCE_DIR/tests/data/corpus.txt"
corpus_small() { head -c 32340 "$CORPUS"; }
pass=0
fail=0
check() { if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $*" >&2; fi; }

# wait_step LOG STEP [TRIES [PAUSE]]: until the training log LOG has step
# STEP, looking TRIES times (1200) PAUSE seconds apart (0.05); 1 if it
# never came
wait_step() {
  local i
  for i in $(seq 1 "${3:-1200}"); do
    grep -q "\"step\":$2," "$1" 2>/dev/null && return 0
    sleep "${4:-0.05}"
  done
  return 1
}

# failure_digest: what the clusters' logs say, printed when a check failed
# (a CI run keeps nothing else of W): the clients' last lines (W's *.err),
# each coordinator's last warnings and errors, and any sanitizer report in
# a process's log
failure_digest() {
  local f
  for f in "$W"/*.err "$W"/*/*.err; do
    [ -s "$f" ] || continue
    echo "--- ${f#"$W"/}, its last lines:"
    tr '\r' '\n' < "$f" | grep -v "^step" | tail -6
  done
  for f in "$W"/*/coord.log; do
    [ -e "$f" ] || continue
    echo "--- ${f#"$W"/}, its last warnings and errors:"
    grep " WARN \| ERROR " "$f" | tail -12
  done
  for f in $(grep -l "AddressSanitizer\|LeakSanitizer\|runtime error:" "$W"/*.log "$W"/*/*.log 2>/dev/null); do
    echo "--- ${f#"$W"/}, a sanitizer's report:"
    grep -A16 "AddressSanitizer\|LeakSanitizer\|runtime error:" "$f" | head -40
  done
}

cluster_lib_exit() {
  [ "$fail" -gt 0 ] && failure_digest >&2
  declare -F test_cleanup >/dev/null && test_cleanup
  local p
  for p in "$W"/*/coord.pid; do
    [ -e "$p" ] && "$N" cluster down --dir "$(dirname "$p")" >/dev/null 2>&1
  done
  pkill -f "$W" 2>/dev/null
  if [ -n "${NL_TEST_KEEP:-}" ]; then echo "kept $W (NL_TEST_KEEP)" >&2; else rm -rf "$W"; fi
}
trap cluster_lib_exit EXIT

# tokens_file FILE B T: a safetensors file of I32 "tokens" [B, T], the
# ids (37 i + 11) mod 256, for neuroctl forward --tokens
tokens_file() {
  $PY - "$1" "$2" "$3" <<'PY'
import json, struct, sys
path, b, t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
toks = [(i * 37 + 11) % 256 for i in range(b * t)]
h = json.dumps({"tokens": {"dtype": "I32", "shape": [b, t], "data_offsets": [0, 4 * len(toks)]}}).encode()
h += b" " * (-len(h) % 8)
open(path, "wb").write(struct.pack("<Q", len(h)) + h + struct.pack("<%di" % len(toks), *toks))
PY
}

# wait_replanned C: until cluster C is ready again with a node dead (the
# coordinator re-planned on the others), looking for up to 60 s; 1 if not
wait_replanned() {
  local i st
  for i in $(seq 1 240); do
    st=$("$N" status --cluster "$1" 2>/dev/null)
    if grep -q "^cluster: ready" <<< "$st" && grep -q " dead " <<< "$st"; then return 0; fi
    sleep 0.25
  done
  return 1
}

# reload_keys C: SIGHUP to cluster C's coordinator, and wait (up to 60 s)
# until its log says it reloaded its authorized_keys; 1 if it never did.
# A key added before is taken only from then on: a node or client that
# came sooner would be refused, on a busy machine even after a sleep.
reload_keys() {
  local i before
  before=$(grep -c "SIGHUP: reloaded" "$1/coord.log")
  kill -HUP "$(cat "$1/coord.pid")" || return 1
  for i in $(seq 1 600); do
    [ "$(grep -c "SIGHUP: reloaded" "$1/coord.log")" -gt "$before" ] && return 0
    sleep 0.1
  done
  echo "reload_keys: $1/coord.log never said the keys were reloaded" >&2
  return 1
}

# small_config FILE HIDDEN LAYERS FFN MAX_SEQ: 4 heads (2 kv), 4 experts,
# a byte vocabulary in one chunk
small_config() {
  cat > "$1" <<YAML
hidden_dim: $2
num_layers: $3
num_heads: 4
num_kv_heads: 2
ffn_dim: $4
num_experts: 4
vocab_size: 256
vocab_chunk: 256
max_seq_len: $5
YAML
}

# replica_node C STAGE R: the key file stem (C/node-K) of the node that is
# replica R (0 or 1) of stage STAGE in C's last plan (coord.log names it
# by id, its join by key)
replica_node() {
  $PY - "$1" "$2" "$3" <<'PY'
import glob, re, sys
c, stage, r = sys.argv[1], sys.argv[2], int(sys.argv[3])
log = open(c + "/coord.log").read()
node = re.findall(r"plan \d+: stage %s on node (\d+) \(replicas on (\d+)\)" % stage, log)[-1][r]
key = re.search(r"node %s joined: .* key (\S{8})\.\.\." % node, log).group(1)
for pub in glob.glob(c + "/node-*.pub"):
    if open(pub).read().startswith(key):
        print(pub[:-4]); break
PY
}

# train_kill_replica C VICTIM REF ARGS...: neuroctl train --cluster C ARGS
# (W/killed.jsonl, W/killed.safetensors, checkpoints under W/ck-killed, the
# first at step 20), and VICTIM's node (replica_node) killed with -9 once
# step 7 is logged. The job goes on by itself: each stage's first live
# replica writes the step under way (step-N.resume1), the job resumes
# from it on the nodes left, and its losses and weights are REF's
# (REF.jsonl, REF.safetensors) to the byte.
train_kill_replica() {
  local c=$1 victim=$2 ref=$3 job rc
  shift 3
  check test -n "$victim"
  "$N" train --cluster "$c" "$@" --checkpoint-every 20 --checkpoint-dir "$W/ck-killed" \
    --log "$W/killed.jsonl" --out "$W/killed.safetensors" 2> "$W/killed.err" &
  job=$!
  wait_step "$W/killed.jsonl" 7 2400
  echo "killing $victim"
  kill -9 "$(cat "$victim.pid")"
  wait $job
  rc=$?
  check test $rc -eq 0
  tr '\r' '\n' < "$W/killed.err" | grep -v "^step" | tail -4
  [ $rc -eq 0 ] || grep -E "WARN|ERROR" "$c/coord.log" | tail -12
  check grep -q '"event":"node_lost"' "$W/killed.jsonl"
  check grep -q "train job 1: resumed at step" "$c/coord.log"
  # it resumed at the step it was lost at, from the survivors' shards
  $PY - "$W/killed.jsonl" "$W/ck-killed" > "$W/salvage.txt" <<'PY'
import glob, json, os, sys
ev = [json.loads(l) for l in open(sys.argv[1]) if '"node_lost"' in l][0]
d = os.path.join(sys.argv[2], "step-%06d.resume1" % ev["lost_step"])
print("lost at step", ev["lost_step"], "resumed at step", ev["resume_step"], "from", ev["source"])
print("ok" if ev["lost_step"] > 0 and ev["resume_step"] == ev["lost_step"]
      and ev["source"] == os.path.join(d, "manifest.json")
      and len(glob.glob(os.path.join(d, "stage-*.safetensors"))) == 2 else "not saved")
PY
  cat "$W/salvage.txt"
  check grep -qx ok "$W/salvage.txt"
  check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" logs "$W/killed.jsonl" "$ref.jsonl" 0
  check $PY "$NL_SOURCE_DIR/tests/cluster_cmp.py" weights "$W/killed.safetensors" "$ref.safetensors" 0
}
