#!/usr/bin/env bash
# A generation served by a node later convicted of computing wrong is run
# again without it (issue 31; docs/security.md, "Generations served by a
# convicted node"). node-2 lies in training (NL_TEST_LIE, so that
# verification convicts it) and in every generation hop it sends
# (NL_TEST_LIE_GEN=1); each batch of session hops waits 200 ms
# (NL_TEST_SLOW_HOP_MS), so that a generation is still running when the
# training job's verification convicts node-2 (28 tokens of 3 hops: 17 s
# for the training to start, run a step and be verified, under a
# sanitizer on a busy machine too):
#  - a generation that finished before the conviction (job 1) gave the
#    liar's tokens; the conviction names it (a warning, and a
#    generation_suspect event on /api/events);
#  - the generations running at the conviction (neuroctl's and one over
#    HTTP) are replayed on the nodes left: the first token they do not give
#    again and those after it are withdrawn (a `rerun` notice); neuroctl's
#    output ends with a line that holds one process's honest tokens, and
#    the HTTP response holds what the honest nodes answer it afterwards.
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20

small_config "$W/cfg.yaml" 32 3 48 32
corpus_small > "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
P=72,101
# one process's tokens: the honest ones
check "$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens $P --max-new 4 \
  --temperature 0 --threads 1 > "$W/short.l" 2>/dev/null
check "$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens $P --max-new 28 \
  --temperature 0 --threads 1 > "$W/long.l" 2>/dev/null

C="$W/c"
env NL_TEST_LIE=bitflip:1:5 NL_TEST_LIE_NODE=node-2 NL_TEST_LIE_GEN=1 NL_TEST_SLOW_HOP_MS=200 \
  "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 3 --model "$W/m.safetensors" --memory 64M \
  --threads 1 --node-timeout-ms 4000 --timeout 60 --verify-rate 1 --http 127.0.0.1:0 \
  > "$W/up.log" 2>&1
check grep -q "on node" "$C/coord.log"

# ---- job 1: a generation through the liar, finished before any conviction ----
check "$N" generate --cluster "$C" --prompt-tokens $P --max-new 4 --temperature 0 \
  > "$W/short.c" 2> "$W/short.err"
check bash -c "! cmp -s '$W/short.c' '$W/short.l'" # the liar's tokens

cat > "$W/complete.py" <<'PY'
import json, sys, urllib.request
base = sys.argv[1].rstrip("/")
body = json.dumps({"prompt": [72, 101], "max_tokens": 28, "temperature": 0}).encode()
rq = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
try:
    r = json.loads(urllib.request.urlopen(rq, timeout=120).read())
    print(json.dumps(r["choices"][0]["text"]))
except urllib.error.HTTPError as e:
    print("HTTP %d %s" % (e.code, e.read().decode(errors="replace")))
PY
# ---- job 2: a long generation (and one over HTTP), and then training,
# which convicts node-2 while they run: each goes on as a job of a new id
# on the nodes left ----
$PY "$W/complete.py" "$(cat "$C/coord/http")" > "$W/http.c" 2>&1 &
http=$!
"$N" generate --cluster "$C" --prompt-tokens $P --max-new 28 --temperature 0 \
  > "$W/long.c" 2> "$W/long.err" &
gen=$!
for i in $(seq 1 600); do # the generation has made a token (the prompt is in)
  [ -s "$W/long.c" ] && break
  sleep 0.05
done
# (at lr 0, so that the weights the generation runs on stay those of one
# process's)
check "$N" train --cluster "$C" --data "$W/data.txt" --steps 3 --batch 8 --seq 16 \
  --microbatches 4 --lr 0 --seed 1 --checkpoint-dir "$W/ck" --log "$W/train.jsonl" \
  2> "$W/train.err"
wait $gen
check test $? -eq 0
wait $http
cat "$W/long.err"
check grep -q "^# banned: convicted of computing wrong.* node  # node-2" "$C/coord/authorized_keys"
check grep -q "job 2: node [0-9]* served this generation and was convicted .* as job [0-9]*" "$C/coord.log"
check grep -q "job [0-9]*: node [0-9]*, which served this generation, was convicted of computing wrong: run again without it, its tokens from [0-9]* on (.*) are withdrawn" \
  "$C/coord.log"
check grep -q "are withdrawn and the ones that follow replace them" "$W/long.err"
# the output's last line: one process's tokens
check bash -c "diff <(tail -n 1 '$W/long.c') <(tail -n 1 '$W/long.l')"
# the completion over HTTP, cut where its tokens were withdrawn (if it had
# made one by the conviction), answers what the honest nodes answer the
# same request now
grep "which served this generation" "$C/coord.log"
$PY "$W/complete.py" "$(cat "$C/coord/http")" > "$W/http.l" 2>&1
cat "$W/http.c" "$W/http.l"
check grep -q '^"' "$W/http.c"
check cmp "$W/http.c" "$W/http.l"
# the finished one is named
check grep -q "job 1: a generation that finished .* s ago was served by node [0-9]*, since convicted" \
  "$C/coord.log"
$PY - "$(cat "$C/coord/http")" > "$W/events" 2>&1 <<'PY'
import socket, sys, time
host, port = sys.argv[1].replace("http://", "").rstrip("/").rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=60)
s.sendall(b"GET /api/events HTTP/1.1\r\nHost: localhost\r\n\r\n")
buf, end = b"", time.time() + 60
while b"event: generation_suspect" not in buf and time.time() < end:
    chunk = s.recv(65536)
    if not chunk:
        break
    buf += chunk
sys.stdout.write(buf.decode(errors="replace"))
PY
check grep -q "event: generation_suspect" "$W/events"
check grep -q '"job": *1' <(grep -A1 "event: generation_suspect" "$W/events")

[ -n "${KEEP:-}" ] && cp "$C"/*.log "$W"/long.* "$W"/short.* "$W"/http.* "$KEEP"/
check "$N" cluster down --dir "$C"
echo "test_cluster_verify_gen: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
