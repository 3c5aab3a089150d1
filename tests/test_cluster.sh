#!/usr/bin/env bash
# The cluster as real processes on loopback: cluster up with 3 nodes;
# forward through the pipeline equals the local forward (max abs diff
# <= 1e-6); greedy and sampled generation equal local generation (the
# token ring, the stop at max_seq_len); Ctrl-C cancels a generation; status shows the
# plan; SIGKILL of a node in the middle of a request gives the client a
# clear error at the heartbeat timeout (within 8 s: not at its --timeout), a generation
# resumes on the new plan by replaying its tokens (the same ids), the
# coordinator stays up and re-plans, and the next request succeeds;
# unauthorised node and client keys are refused; cluster down stops all;
# a session evicted from a node's KV budget fails that generation only.
. "$(dirname "$0")/cluster_lib.sh"
C="$W/cluster"

small_config "$W/cfg.yaml" 64 6 64 256
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 3 --model "$W/m.safetensors" --memory 64M --threads 1 \
  --node-timeout-ms 2000 --timeout 60
"$N" status --cluster "$C" > "$W/status.txt" 2>&1
check grep -q "ready" "$W/status.txt"
check test "$(grep -c serving "$W/status.txt")" -eq 3

# forward: the cluster against one process, same checkpoint
tokens_file "$W/in.safetensors" 3 21
check "$N" forward "${DEV[@]}" --model "$W/m.safetensors" --tokens "$W/in.safetensors" --out "$W/local.safetensors" --threads 1
check "$N" forward --cluster "$C" --tokens "$W/in.safetensors" --out "$W/remote.safetensors"
cat > "$W/compare.py" <<'PY'
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
print("forward: max abs diff %.3g, aux %.9g vs %.9g" % (d, a["aux_loss"][1][0], b["aux_loss"][1][0]))
assert d <= 1e-6, d
assert abs(a["aux_loss"][1][0] - b["aux_loss"][1][0]) <= 1e-6 * max(1, abs(a["aux_loss"][1][0]))
PY
check $PY "$W/compare.py" "$W/local.safetensors" "$W/remote.safetensors"

# greedy generation: the same ids
l=$("$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 72,101,108 --max-new 12 --temperature 0 --threads 1 | head -1)
r=$("$N" generate --cluster "$C" --prompt-tokens 72,101,108 --max-new 12 --temperature 0 | head -1)
check test -n "$l"
check test "$l" = "$r"
# the token ring: the last stage feeds each token to the first itself; a
# longer greedy run, a sampled one, and one that stops at max_seq_len (256)
# all give the local ids; both tools report their pace on stderr
l=$("$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 72,101,108 --max-new 40 --temperature 0.9 \
    --top-p 0.9 --seed 11 --threads 1 2>"$W/l.err" | head -1)
r=$("$N" generate --cluster "$C" --prompt-tokens 72,101,108 --max-new 40 --temperature 0.9 --top-p 0.9 \
    --seed 11 2>"$W/r.err" | head -1)
check test "$(echo "$l" | wc -w)" -eq 40
check test "$l" = "$r"
check grep -q "^generate: 40 tokens: first after .* ms, then 39 in .* tokens/s)" "$W/l.err"
check grep -q "^generate: 40 tokens: first after .* ms, then 39 in .* tokens/s)" "$W/r.err"
long=$(seq -s, 1 250)
l=$("$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens "$long" --max-new 20 --temperature 0 --threads 1 | head -1)
r=$("$N" generate --cluster "$C" --prompt-tokens "$long" --max-new 20 --temperature 0 | head -1)
check test "$(echo "$l" | wc -w)" -eq 6 # 250 + 6: the 256 positions, as HTTP's max_tokens
check test "$l" = "$r"
greedy=$("$N" generate --cluster "$C" --prompt-tokens 72,101,108 --max-new 12 --temperature 0 | head -1)

# Ctrl-C cancels a generation: the client exits 130, the coordinator ends
# the job, the stages drop the hop still in flight (not an error), and the
# next request is served (tries again if a run ended before the signal)
cut=0
for try in 1 2 3 4 5; do
  "$N" generate --cluster "$C" --prompt-tokens 1,2,3 --max-new 250 --temperature 0 \
    > "$W/cut.out" 2> "$W/cut.err" &
  g=$!
  for i in $(seq 1 6000); do [ -s "$W/cut.out" ] && break; sleep 0.01; done
  kill -INT $g
  wait $g; rc=$?
  if [ $rc -eq 130 ]; then cut=1; break; fi
done
check test $cut -eq 1
check grep -q "interrupted: cancelling job" "$W/cut.err"
check test "$(wc -w < "$W/cut.out")" -lt 250
sleep 0.3
check grep -q "cancelled by its client" "$C/coord.log"
check test "$(cat "$C"/node-*.log | grep -c "refused")" -eq 0
check test "$("$N" generate --cluster "$C" --prompt-tokens 72,101,108 --max-new 12 --temperature 0 | head -1)" = "$greedy"

# roles (issue 15): keygen prints the authorized_keys line; added (SIGHUP),
# a plain client's status shows no node's key or endpoint, the operator's
# (cluster up made it admin) does; a client key cannot JOIN: on the nodes'
# endpoint its handshake is refused (finding 8: clients have their own
# socket), on the clients' its JOIN is refused by role
line=$("$N" keygen --out "$W/plain" --role client 2>/dev/null)
check test "${line##* }" = client
echo "$line" >> "$C/coord/authorized_keys"
check reload_keys "$C"
EPN=$(cat "$C/coord/endpoint")
EPC=$(cat "$C/coord/client_endpoint")
check test "$EPN" != "$EPC"
nkey=$(cat "$C/node-1.pub")
plain=$("$N" status --coordinator "$EPC" --key "$W/plain.key" --coordinator-key "$C/coord/coordinator.pub" --json 2>&1)
check grep -q '"nodes"' <<< "$plain"
check test "$(grep -cF -- "$nkey" <<< "$plain")" -eq 0
check grep -qF -- "$nkey" <<< "$("$N" status --cluster "$C" --json 2>&1)"
out=$("$N" status --coordinator "$EPN" --key "$W/plain.key" --coordinator-key "$C/coord/coordinator.pub" --timeout 5 2>&1); rc=$?
check test $rc -ne 0
check grep -q "refused this key.*--client-listen" <<< "$out"
timeout 20 "$(dirname "$N")/../node/neuronode" join "$EPC" --key "$W/plain.key" \
  --coordinator-key "$C/coord/coordinator.pub" --memory 64M --threads 1 --connect-timeout 3 \
  > "$W/plainjoin.log" 2>&1
check grep -q "not for a key of this role" "$W/plainjoin.log"
timeout 20 "$(dirname "$N")/../node/neuronode" join "$EPN" --key "$W/plain.key" \
  --coordinator-key "$C/coord/coordinator.pub" --memory 64M --threads 1 --connect-timeout 3 \
  > "$W/plainjoin2.log" 2>&1
check grep -q "refused this key" "$W/plainjoin2.log"

# unauthorised keys
"$N" keygen --out "$W/stranger" >/dev/null
out=$("$N" status --coordinator "$(cat "$C/coord/client_endpoint")" --key "$W/stranger.key" \
      --coordinator-key "$C/coord/coordinator.pub" --timeout 3 2>&1); rc=$?
check test $rc -ne 0
NODE="$(dirname "$N")/../node/neuronode"
timeout 20 "$NODE" join "${DEV[@]}" "$(cat "$C/coord/endpoint")" --key "$W/stranger.key" \
  --coordinator-key "$C/coord/coordinator.pub" --memory 64M --threads 1 --connect-timeout 3 \
  > "$W/stranger.log" 2>&1; rc=$?
check test $rc -ne 0
check test "$("$N" status --cluster "$C" | grep -c serving)" -eq 3

# SIGKILL a node in the middle of requests. Forward requests run back to
# back until one fails: the client gets a clear error within the heartbeat
# timeout plus one second of the node going silent. A sampled generation in
# flight (its node stopped while it runs, then killed) waits for the new
# plan, replays its tokens there and goes on: it gives the local ids.
want=$("$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 1,2,3 --max-new 250 \
  --temperature 0.8 --seed 5 --threads 1 2>/dev/null | head -1)
( for i in $(seq 1 2000); do
    "$N" forward --cluster "$C" --tokens "$W/in.safetensors" --out "$W/fwd.safetensors" \
      --timeout 30 > /dev/null 2> "$W/fwd.err" || exit 1
  done; exit 0 ) &
fwd=$!
victim=$(cat "$C/node-2.pid")
stopped=0
for try in 1 2 3 4 5; do
  "$N" generate --cluster "$C" --prompt-tokens 1,2,3 --max-new 250 --temperature 0.8 --seed 5 \
    --timeout 30 > "$W/gen.out" 2> "$W/gen.err" &
  g=$!
  for i in $(seq 1 6000); do [ -s "$W/gen.out" ] && break; sleep 0.01; done
  kill -STOP "$victim"
  t0=$(date +%s.%N)
  sleep 0.2
  if kill -0 $g 2>/dev/null; then stopped=1; break; fi # the ring stalls: mid-generation
  kill -CONT "$victim"
  wait $g
done
check test $stopped -eq 1
kill -9 "$victim"
wait $fwd; rc=$?
t1=$(date +%s.%N)
check test $rc -ne 0
check grep -q "node" "$W/fwd.err"
cat "$W/fwd.err"
elapsed=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
echo "client saw the failure $elapsed s after the node went silent (heartbeat timeout 2 s)"
# at the heartbeat timeout (2 s and the coordinator's tick), not at the
# client's --timeout: the bound leaves a busy machine room for the rest
check awk -v e="$elapsed" 'BEGIN { exit !(e <= 8.0) }'
wait $g; rc=$?
check test $rc -eq 0
check test "$(head -1 "$W/gen.out")" = "$want"
check grep -q "dead; resuming at token" "$W/gen.err"
check grep -q "^generate: 250 tokens" "$W/gen.err"
check grep -q "replayed [0-9]* tokens; resumed" "$C/coord.log"
check kill -0 "$(cat "$C/coord.pid")"
# the coordinator re-plans on the two nodes left; the next request succeeds
check wait_replanned "$C"
check test "$("$N" status --cluster "$C" | grep -c serving)" -eq 2
check "$N" forward --cluster "$C" --tokens "$W/in.safetensors" --out "$W/remote2.safetensors"
check $PY "$W/compare.py" "$W/local.safetensors" "$W/remote2.safetensors"

check "$N" cluster down --dir "$C"
sleep 0.5
check test -z "$(pgrep -f "$C" || true)"

# without a checkpoint: nodes initialise from the shared seed, which must
# equal neuroctl init with that seed
C2="$W/cluster2"
check "$N" cluster up "${DEV[@]}" --dir "$C2" --nodes 2 --config "$W/cfg.yaml" --seed 7 --memory 64M \
  --threads 1 --timeout 60
check "$N" forward --cluster "$C2" --tokens "$W/in.safetensors" --out "$W/remote3.safetensors"
check $PY "$W/compare.py" "$W/local.safetensors" "$W/remote3.safetensors"
check "$N" cluster down --dir "$C2"

# a job's failure on a node fails that job only: one node whose KV budget
# holds one session of 253 positions (6 layers x 253 x 256 bytes); a second
# generation evicts the first, which fails, naming the eviction, while the
# second runs to the end with the local ids (tries again if the first had
# ended before the second opened). Each batch waits 5 ms first
# (NL_TEST_SLOW_HOP_MS), so the first's 250 tokens take over a second, not
# the few milliseconds that would end it before the second client opens.
C3="$W/cluster3"
check env NL_TEST_SLOW_HOP_MS=5 "$N" cluster up "${DEV[@]}" --dir "$C3" --nodes 1 --model "$W/m.safetensors" \
  --memory 64M --threads 1 --kv-budget 600000 --timeout 60
# two generations at once on a single stage: it feeds each its own tokens
# (one queued token per session); both give the local ids
for p in 1,2,3 5,6,7; do
  "$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens $p --max-new 100 --temperature 0 \
    --threads 1 2>/dev/null | head -1 > "$W/want-$p"
  "$N" generate --cluster "$C3" --prompt-tokens $p --max-new 100 --temperature 0 --timeout 20 \
    2>/dev/null > "$W/got-$p" &
done
wait
for p in 1,2,3 5,6,7; do
  check test -s "$W/want-$p"
  check cmp -s "$W/want-$p" <(head -1 "$W/got-$p")
done
want=$("$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 5,6,7 --max-new 250 --temperature 0 \
  --threads 1 | head -1)
evicted=0
for try in 1 2 3 4 5; do
  "$N" generate --cluster "$C3" --prompt-tokens 1,2,3 --max-new 250 --temperature 0 \
    --timeout 20 > "$W/a.out" 2> "$W/a.err" &
  a=$!
  for i in $(seq 1 6000); do [ -s "$W/a.out" ] && break; sleep 0.01; done
  got=$("$N" generate --cluster "$C3" --prompt-tokens 5,6,7 --max-new 250 --temperature 0 \
    --timeout 20 2> "$W/b.err" | head -1)
  wait $a; rc=$?
  if [ $rc -ne 0 ]; then evicted=1; break; fi
done
check test $evicted -eq 1
check grep -q "evicted (KV budget full)" "$W/a.err"
check test "$got" = "$want"
check grep -q "^generate: 250 tokens" "$W/b.err"
check "$N" cluster down --dir "$C3"

# nodes that cannot hold the model: once every node joined and the plan
# still lacks memory, cluster up says so and takes the cluster down, long
# before its --timeout (it waited the whole timeout before)
t0=$(date +%s)
"$N" cluster up "${DEV[@]}" --dir "$W/short" --nodes 2 --config "$W/cfg.yaml" --memory 2M \
  --kv-budget 1M --threads 1 --timeout 600 > "$W/short.up" 2>&1
check test $? -eq 1
check grep -q "cluster up: the 2 node(s) cannot hold the model: not enough capacity: plan: needs" \
  "$W/short.up"
check test $(($(date +%s) - t0)) -lt 300
check test ! -e "$W/short/coord.pid"

echo "test_cluster: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
