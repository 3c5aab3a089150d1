#!/usr/bin/env bash
# The daemons shut down without leaks: a coordinator and two nodes (two
# stages) run a short training job and a generation; one node is stopped
# with SIGTERM, the rest with `cluster down` (the coordinator asks its nodes
# to leave, then stops). Under the ASan build (scripts/test.sh exports
# ASAN_OPTIONS=detect_leaks=1) a process that leaks writes a LeakSanitizer
# report to its stderr, which `cluster up` sends to DIR/NAME.log and which
# no other test reads: this one fails if any of those logs, or the client's
# stderr, holds one (or any other sanitizer report). In a build without
# sanitizers it checks the same clean shutdown. Every build: each daemon's
# count of received messages it never closed is 0 (nl_net_parts_check).
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20 # equal throughputs: the plan does not depend on probes
C="$W/cluster"

small_config "$W/cfg.yaml" 32 2 48 64
corpus_small > "$W/data.txt"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 2 --model "$W/m.safetensors" --memory 64M \
  --threads 1 --timeout 120
check "$N" train --cluster "$C" --data "$W/data.txt" --steps 2 --batch 4 --seq 16 --microbatches 2 \
  --lr 3e-3 --seed 1 --checkpoint-dir "$W/ck" --out "$W/out.safetensors" 2> "$W/train.err" > /dev/null
r=$("$N" generate --cluster "$C" --prompt-tokens 72,101,108 --max-new 8 --temperature 0 \
  2> "$W/generate.err" | head -1)
check test "$(echo "$r" | wc -w)" -eq 8

# node 1: SIGTERM, as a service manager stops it; waited for (generously)
pid=$(cat "$C/node-1.pid")
kill -TERM "$pid"
for i in $(seq 1 1200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
check test "$(kill -0 "$pid" 2>/dev/null && echo running)" = ""
# the coordinator and node 2: cluster down (SIGUSR2, LEAVE, then SIGTERM);
# it kills what ignores that, and says so
"$N" cluster down --dir "$C" > "$W/down.out" 2>&1
check test "$(grep -c "ignored SIGTERM" "$W/down.out")" -eq 0
check grep -q "leaving: stopped by a signal" "$C/node-1.log"
check grep -q "leaving: asked to leave by the coordinator" "$C/node-2.log"

# no sanitizer report in any process's stderr, and no received message
# left open (each daemon counts them itself, nl_net_parts_check: in every
# build, and the one check of ours that LeakSanitizer's suppression of
# libzmq's own allocations, tests/lsan.supp, leaves to us)
for f in "$C/coord.log" "$C"/node-*.log "$W/train.err" "$W/generate.err"; do
  if grep -q "ERROR: \(LeakSanitizer\|AddressSanitizer\)\|runtime error:\|never closed" "$f"; then
    echo "FAIL: a sanitizer report, or a message never closed, in $f:" >&2
    grep -A 12 "ERROR: \(LeakSanitizer\|AddressSanitizer\)\|runtime error:\|never closed" "$f" |
      head -40 >&2
    fail=$((fail + 1))
  else
    pass=$((pass + 1))
  fi
done
echo "test_cluster_leaks: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
