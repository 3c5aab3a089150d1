#!/usr/bin/env bash
# Integration test of issue 20 (no lost work, no guessing) and issue 21's
# progress output, through the real binaries:
#  - train keeps its last step without --out, and with --checkpoint-every;
#    a disk that fills keeps the model elsewhere, or names the last
#    checkpoint to resume from;
#    Ctrl-C keeps the steps done (exit 130, no temporary left) and resumes;
#    a second run given a running one's --checkpoint-dir, --out or --log
#    is refused, naming its pid;
#  - init, grow, export, tokenizer train and train --out refuse to replace
#    a file without --force;
#  - after cluster down a client fails at once; the four key mistakes and a
#    dead port are told apart at once (client and node); cluster up prints
#    a coordinator's early exit at once and warns of a --memory the KV
#    budget fills; a public key given as the secret is named;
#  - --checkpoint-dir, --out and --log that cannot be written (/proc) are
#    refused before the first step, locally and on a cluster;
#  - --seq is checked against the model first; generate says when
#    max_seq_len cut it short; missing flags are named; small messages;
#  - progress: a line per --progress-every into a pipe, the JSONL log per
#    step; on a terminal one line redrawn in place within its width;
#  - --help of train, generate and forward names the cluster flags.
set -uo pipefail
N="$NL_BUILD_DIR/cli/neuroctl"
NODE="$NL_BUILD_DIR/node/neuronode"
DEV=(--device "${NL_TEST_DEVICE:-cpu}")
W=$(mktemp -d)
cleanup() {
  for c in "$W"/c*/; do [ -e "$c/coord.pid" ] && "$N" cluster down --dir "$c" >/dev/null 2>&1; done
  rm -rf "$W"
}
trap cleanup EXIT
pass=0
fail=0
check() { if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $*" >&2; fi; }
# fast S CMD...: run CMD; its exit status, or 99 (and "SLOW") when it took S seconds or more
fast() {
  local s=$1 t0 t1 rc
  shift
  t0=$(date +%s.%N)
  "$@"
  rc=$?
  t1=$(date +%s.%N)
  if awk -v a="$t0" -v b="$t1" -v s="$s" 'BEGIN { exit !(b - a >= s) }'; then
    echo "SLOW: $* took $(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }') s" >&2
    return 99
  fi
  return $rc
}

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
"$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 3 >/dev/null
for i in $(seq 1 200); do echo "the quick brown fox $i jumps over the lazy dog"; done > "$W/data.txt"
T=(--data "$W/data.txt" --batch 2 --seq 16 --lr 1e-3 --threads 2)

# ---- 1. the last step is always kept, and the last line says where ----
out=$(cd "$W" && "$N" train "${DEV[@]}" --model m.safetensors "${T[@]}" --steps 3 2>&1); rc=$?
check test $rc -eq 0
check test -s "$W/checkpoints/step-000003.safetensors"
check test "$(tail -1 <<< "$out")" = "wrote checkpoints/step-000003.safetensors (step 3)"
"$N" train "${DEV[@]}" --model "$W/m.safetensors" "${T[@]}" --steps 5 --checkpoint-every 2 \
  --checkpoint-dir "$W/ck1" 2> "$W/ck1.err"
check test $? -eq 0
check test -s "$W/ck1/step-000002.safetensors"
check test -s "$W/ck1/step-000004.safetensors"
check test -s "$W/ck1/step-000005.safetensors" # not a multiple of 2: kept all the same
check test "$(tail -1 "$W/ck1.err")" = "wrote $W/ck1/step-000005.safetensors (step 5)"

# ---- 1a. --log appends: a second run into the same log keeps the first's records ----
for r in 1 2; do
  "$N" train "${DEV[@]}" --model "$W/m.safetensors" "${T[@]}" --steps 2 --log "$W/two.jsonl" \
    --checkpoint-dir "$W/ck-log$r" 2>/dev/null
done
check test "$(grep -c '"step":' "$W/two.jsonl")" -eq 4

# ---- 1b. a disk that fills during the run (a small tmpfs in a mount
# namespace of this test): --out that cannot be written at the end keeps
# the model in the checkpoint directory and says so; a checkpoint that
# cannot be written names the last one kept and the --resume to use ----
ck=$(stat -c %s "$W/ck1/step-000002.safetensors")
full() { unshare -m sh -c 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"' _ "$@"; }
mkdir -p "$W/full"
out=$(full 16k "$W/full" "$N" train "${DEV[@]}" --model "$W/m.safetensors" "${T[@]}" --steps 3 \
  --out "$W/full/o.safetensors" --checkpoint-dir "$W/ck-out" 2>&1); rc=$?
check test $rc -eq 1
check grep -q "No space left on device" <<< "$out"
check test "$(tail -1 <<< "$out")" = "kept the trained model in $W/ck-out/step-000003.safetensors instead"
check "$N" train "${DEV[@]}" --resume "$W/ck-out/step-000003.safetensors" "${T[@]}" --steps 4 \
  --out "$W/ck-out/resumed.safetensors"
out=$(full $((ck * 3 / 2)) "$W/full" sh -c '"$@"; r=$?; ls "'"$W"'/full/ck"; exit $r' _ \
  "$N" train "${DEV[@]}" --model "$W/m.safetensors" "${T[@]}" --steps 6 --checkpoint-every 2 \
  --checkpoint-dir "$W/full/ck" 2>&1); rc=$?
check test $rc -eq 1
check grep -q "No space left on device" <<< "$out"
check grep -qF "the last checkpoint is $W/full/ck/step-000002.safetensors (continue with --resume $W/full/ck/step-000002.safetensors)" <<< "$out"
check test "$(tail -1 <<< "$out")" = "step-000002.safetensors" # and nothing half-written beside it

# ---- 2. Ctrl-C: stop at a step boundary, keep the steps, exit 130 ----
"$N" train "${DEV[@]}" --model "$W/m.safetensors" "${T[@]}" --steps 1000000 --checkpoint-dir "$W/ck2" \
  --checkpoint-every 999999 --out "$W/int.safetensors" --log "$W/int.jsonl" 2> "$W/int.err" &
pid=$!
for _ in $(seq 1 600); do [ -s "$W/int.jsonl" ] && break; sleep 0.1; done
# ---- 2a. while it runs, a second run given its --checkpoint-dir, --out or --log is refused
# before it writes anything, and the message names the first run's pid ----
for f in "--checkpoint-dir $W/ck2" "--out $W/int.safetensors" "--log $W/int.jsonl"; do
  # shellcheck disable=SC2086 # $f is a flag and its value
  out=$("$N" train "${DEV[@]}" --model "$W/m.safetensors" "${T[@]}" --steps 2 \
    --checkpoint-dir "$W/ck2-other" $f 2>&1); rc=$?
  check test $rc -eq 1
  check grep -qF -- "$f: another run (pid $pid) is writing there" <<< "$out"
done
check test ! -e "$W/int.safetensors"
check test ! -e "$W/ck2/step-000002.safetensors"
check test "$(grep -c '^{"step":1,' "$W/int.jsonl")" -eq 1 # the first run's records only
kill -INT "$pid"
for _ in $(seq 1 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$pid" 2>/dev/null; then # Ctrl-C did not stop it within 60 s
  kill -KILL "$pid"
  check false "train stopped on SIGINT"
fi
wait "$pid"
check test $? -eq 130
kept=$(sed -n 's/^interrupted after step \([0-9]*\) of 1000000: kept \(.*\) (continue with --resume .*)$/\2/p' "$W/int.err")
check test -s "$kept"
check test "$(find "$W/ck2" -name '*.tmp*' | wc -l)" -eq 0
check test "$(find "$W" -name '*.lock' | wc -l)" -eq 0 # the locks go with the run
done_steps=$(sed -n 's/^interrupted after step \([0-9]*\) of.*/\1/p' "$W/int.err")
check test "$kept" = "$W/ck2/step-$(printf %06d "$done_steps").safetensors"
check "$N" train "${DEV[@]}" --resume "$kept" "${T[@]}" --steps $((done_steps + 1)) --out "$W/resumed.safetensors"

# ---- 3. no silent replacement of a file a user cares about ----
cp "$W/m.safetensors" "$W/m.orig"
out=$("$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 4 2>&1); rc=$?
check test $rc -eq 1
check grep -qF -- "--out $W/m.safetensors: the file exists (give --force to replace it)" <<< "$out"
check cmp "$W/m.safetensors" "$W/m.orig"
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 3 --force
check cmp "$W/m.safetensors" "$W/m.orig" # the same seed: the same bytes
"$N" grow --model "$W/m.safetensors" --out "$W/m.orig" --vocab-size 300 >/dev/null 2>&1
check test $? -eq 1
check "$N" grow --model "$W/m.safetensors" --out "$W/grown.safetensors" --vocab-size 300
mkdir -p "$W/shards"
"$NL_BUILD_DIR/tests/make_shards" "$W/resumed.safetensors" "$W/shards" 1 >/dev/null
"$N" export --manifest "$W/shards" --out "$W/m.orig" >/dev/null 2>&1
check test $? -eq 1
check "$N" export --manifest "$W/shards" --out "$W/m.orig" --force
out=$("$N" tokenizer train --input "$W/data.txt" --vocab-size 300 --out "$W/m.orig" --quiet 2>&1)
check test $? -eq 1
check grep -qF -- "--out $W/m.orig: the file exists" <<< "$out"
check test "$(wc -l <<< "$out")" -eq 1 # that line alone (no empty error after it)
check "$N" tokenizer train --input "$W/data.txt" --vocab-size 300 --out "$W/m.orig" --quiet --force
out=$("$N" train "${DEV[@]}" --model "$W/m.safetensors" "${T[@]}" --steps 1 --out "$W/m.orig" 2>&1); rc=$?
check test $rc -eq 1
check grep -qF -- "--out $W/m.orig: the file exists" <<< "$out"
check test "$(grep -c training <<< "$out")" -eq 0 # refused before any work
out=$("$N" train --cluster "$W/nocluster" --data "$W/data.txt" --steps 1 --out "$W/m.orig" 2>&1); rc=$?
check test $rc -eq 1 # the cluster's --out too, before it looks for the cluster
check grep -qF -- "--out $W/m.orig: the file exists" <<< "$out"

# ---- 8. --seq against the model, before any work ----
out=$(fast 3 "$N" train "${DEV[@]}" --model "$W/m.safetensors" --data "$W/data.txt" --steps 1 --seq 100000 2>&1); rc=$?
check test $rc -eq 2
check grep -qF -- "--seq 100000: the model's max_seq_len is 64" <<< "$out"
# no --seq: the default 256 shrinks to max_seq_len 64
out=$("$N" train "${DEV[@]}" --model "$W/m.safetensors" --data "$W/data.txt" --steps 1 --batch 1 \
  --threads 2 --out "$W/s64.safetensors" 2>&1); rc=$?
check test $rc -eq 0
check grep -q "1 steps of 1 x 64 in" <<< "$out"

# ---- 9. generate at max_seq_len says so ----
"$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 1,2,3,4 --max-new 200 \
  --temperature 0 > "$W/gen.out" 2> "$W/gen.err"
check test $? -eq 0
check test "$(head -1 "$W/gen.out" | wc -w)" -eq 60 # with the prompt's 4: the 64 positions
check grep -q "stopped after 60 of --max-new 200 tokens: with the prompt's 4 they reach the model's max_seq_len 64" "$W/gen.err"
# exactly to the context's end: all of them, nothing to say
"$N" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 1,2,3,4 --max-new 60 \
  --temperature 0 > "$W/gen60.out" 2> "$W/gen60.err"
check test "$(head -1 "$W/gen60.out" | wc -w)" -eq 60
check test -z "$(grep "stopped after" "$W/gen60.err")"

# ---- 11. smaller ones ----
out=$("$N" train 2>&1); rc=$?
check test $rc -eq 2
check test "$(head -1 <<< "$out")" = "neuroctl train: missing --model (or --resume)"
out=$("$N" train --model "$W/m.safetensors" --steps 2 2>&1)
check test "$(head -1 <<< "$out")" = "neuroctl train: missing --data"
mkdir -p "$W/outdir"
out=$("$N" train --model "$W/m.safetensors" --data "$W/data.txt" --steps 2 --out "$W/outdir" \
  --force 2>&1); rc=$?
check test $rc -eq 1
check grep -qF -- "--out $W/outdir: is a directory" <<< "$out"
check test "$(grep -c training <<< "$out")" -eq 0 # refused before any work
out=$("$N" train --model "$W/m.safetensors" --resume "$W/m.safetensors" --data "$W/data.txt" \
  --steps 2 2>&1); rc=$?
check test $rc -eq 2
check grep -qF "give --model or --resume, not both" <<< "$out"
out=$("$N" forward --model "$W/m.safetensors" 2>&1)
check test "$(head -1 <<< "$out")" = "neuroctl forward: missing --tokens"
out=$("$NL_BUILD_DIR/coordinator/neurocoord" --listen 'tcp://127.0.0.1:*' 2>&1); rc=$?
check test $rc -eq 2
check test "$(head -1 <<< "$out")" = "neurocoord: missing --state-dir"
out=$("$NL_BUILD_DIR/coordinator/neurocoord" --listen 'tcp://127.0.0.1:*' --state-dir "$W/cs" \
  --model a --config b 2>&1)
check test "$(head -1 <<< "$out")" = "neurocoord: give at most one of --model, --config and --resume"
out=$("$N" train --model "$W/m.safetensors" --data "$W" --steps 2 2>&1); rc=$?
check test $rc -eq 1
check grep -qF -- "--data $W: is a directory" <<< "$out"
out=$("$N" train --cluster "$W/nocluster" --data "$W" --steps 2 2>&1); rc=$?
check test $rc -eq 1
check grep -qF -- "--data $W: is a directory" <<< "$out"
out=$("$N" init --config "$W/cfg.yaml" --out /nonexistent/dir/x 2>&1)
check grep -q "/nonexistent/dir/x: cannot create" <<< "$out"
check test "$(grep -c '\.tmp' <<< "$out")" -eq 0
out=$("$N" generate --model "$W/data.txt" --prompt-tokens 1 2>&1)
check grep -q "data.txt: not a safetensors file" <<< "$out"
# an error of a run under way does not start with a blank line
out=$("$N" train "${DEV[@]}" --resume "$W/checkpoints/step-000003.safetensors" "${T[@]}" --steps 2 \
  --out "$W/x.safetensors" 2>&1); rc=$?
check test $rc -eq 1
check test "$(head -1 <<< "$out")" = "neuroctl train: --steps 2: the checkpoint is already at step 3 (NL_ERR_INVALID)"

# ---- 12, 13. --help names the cluster flags; text goes through the tokenizer ----
for cmd in train generate forward; do
  h=$("$N" $cmd --help)
  check grep -qF -- "--cluster DIR" <<< "$h"
  check grep -qF -- "--coordinator tcp://HOST:PORT" <<< "$h"
done
check grep -q "through the model's tokenizer" <<< "$("$N" train --help)"

# ---- 21.5 progress: into a pipe a line per --progress-every, the log per step ----
"$N" train "${DEV[@]}" --model "$W/m.safetensors" "${T[@]}" --steps 6 --out "$W/p.safetensors" \
  --log "$W/p.jsonl" --progress-every 3600 2> "$W/p.err"
check test "$(grep -c '^step ' "$W/p.err")" -eq 2 # the first and the last
check grep -q '^step 1/6 ' "$W/p.err"
check grep -q '^step 6/6 ' "$W/p.err"
check test "$(wc -l < "$W/p.jsonl")" -eq 6
"$N" train "${DEV[@]}" --model "$W/m.safetensors" "${T[@]}" --steps 6 --out "$W/p0.safetensors" \
  --progress-every 0 2> "$W/p0.err"
check test "$(grep -c '^step ' "$W/p0.err")" -eq 6
# on a terminal 30 columns wide (script(1) makes one): every redraw fits,
# and clears what was there
if command -v script >/dev/null; then
  printf -v cmd '%q ' "$N" train "${DEV[@]}" --model "$W/m.safetensors" "${T[@]}" --steps 4 \
    --out "$W/tty.safetensors"
  COLUMNS=30 script -qec "stty cols 30 2>/dev/null; $cmd" /dev/null > "$W/tty.out" 2>&1
  check test $? -eq 0
  check python3 - "$W/tty.out" <<'PY'
import re, sys
raw = open(sys.argv[1], "rb").read().decode("utf-8", "replace")
redraws = [r for r in raw.split("\r") if r.startswith("step ")]
assert len(redraws) == 4, redraws
for r in redraws:
    text = r.split("\x1b[K")[0]
    assert len(text) <= 29, (len(text), text)
    assert "\x1b[K" in r, r  # what a longer line left is cleared
PY
else
  echo "test_cli_nolost: no script(1): the terminal check is skipped" >&2
fi

# ---- 11. a job cancelled elsewhere: "was cancelled", not "cancelled: cancelled" ----
printf 'status running running\nstatus cancelled cancelled\n' > "$W/cx.script"
rm -f "$W/coord.sock"
"$NL_BUILD_DIR/tests/fake_coord" "ipc://$W/coord.sock" "$W/cx.script" "$W/cx.sent" 2>/dev/null &
fake=$!
for _ in $(seq 1 600); do [ -S "$W/coord.sock" ] && break; sleep 0.1; done
out=$("$N" train --coordinator "ipc://$W/coord.sock" --plaintext --data "$W/data.txt" --steps 2 2>&1); rc=$?
wait "$fake"
check test $rc -eq 1
check grep -qx "neuroctl train: job [0-9]* was cancelled" <<< "$(grep -v '^warning' <<< "$out")"

# ---- a cluster for 4, 5, 6, 7, 10 ----
# 10: a KV budget that fills what a node offers: refused on the terminal,
# in the units typed, before any process starts
out=$("$N" cluster up --dir "$W/c0" --nodes 1 --model "$W/m.safetensors" --memory 256M \
  --kv-budget 256M --threads 1 --timeout 60 2>&1); rc=$?
check test $rc -eq 2
check grep -qF "cluster up: --kv-budget 256M leaves nothing of --memory 256M" <<< "$out"
check test ! -e "$W/c0/coord.log"
# and neuronode refuses it too, naming both (a node started by hand)
"$N" keygen --out "$W/nk" > /dev/null 2>&1
"$NODE" join tcp://127.0.0.1:9 --key "$W/nk.key" --coordinator-key "$W/nk.pub" --memory 64M \
  --kv-budget 64M --threads 1 > "$W/nkv.log" 2>&1
check test $? -eq 1
check grep -q "kv-budget 64.0 MiB leaves nothing of the 64.0 MiB device cpu offers" "$W/nkv.log"
out=$("$N" cluster up --dir "$W/c1" --nodes 1 --model "$W/m.safetensors" --memory 256M --threads 1 \
  --timeout 60 2>&1); rc=$?
check test $rc -eq 0
# the default budget is a quarter of what a node offers (at most 256M); the plans get the rest
check grep -q "offering 256.0 MiB (KV budget 64.0 MiB of it" "$W/c1/node-1.log"
EP=$(cat "$W/c1/coord/client_endpoint") # clients' (neurocoord --client-listen)
EPN=$(cat "$W/c1/coord/endpoint")      # nodes' (--listen)
"$N" keygen --out "$W/other" >/dev/null 2>&1
K=(--key "$W/c1/client.key" --coordinator-key "$W/c1/coord/coordinator.pub")
check fast 5 "$N" status --coordinator "$EP" "${K[@]}" --timeout 30
out=$("$N" status --coordinator "$EP" "${K[@]}")
check grep -q "+e the embedding, +h the output head" <<< "$out"
check grep -q "\[0,2)+e+h" <<< "$out"
# 9 on a cluster: generate at max_seq_len says so
"$N" generate --cluster "$W/c1" --prompt-tokens 1,2,3,4 --max-new 200 --temperature 0 \
  > "$W/rgen.out" 2> "$W/rgen.err"
check test $? -eq 0
check grep -q "stopped after 60 of --max-new 200 tokens: .* max_seq_len 64" "$W/rgen.err"
check test "$(head -1 "$W/rgen.out" | wc -w)" -eq 60 # as many as the HTTP API's largest max_tokens
# 8 on a cluster: no --seq, the default 256 fits the model's max_seq_len 64;
# a typed --seq past it is refused naming it
"$N" train --cluster "$W/c1" --data "$W/data.txt" --steps 1 --batch 2 --checkpoint-dir "$W/rck" \
  > /dev/null 2> "$W/rseq.err"
check test $? -eq 0
check grep -q "of 2 x 64" "$W/rseq.err"
"$N" train --cluster "$W/c1" --data "$W/data.txt" --steps 1 --batch 2 --seq 100 \
  --checkpoint-dir "$W/rck2" > /dev/null 2> "$W/rseq2.err"
check test $? -eq 1
check grep -qF -- "--seq 100: the model's max_seq_len is 64" "$W/rseq2.err"
# an output that cannot be written is found before the first step, locally
# and on a cluster, by trying (root passes access() even on /proc)
for a in "--checkpoint-dir /proc --checkpoint-every 1" "--out /proc/x.safetensors" \
         "--log /proc/x.jsonl"; do
  for where in "--model $W/m.safetensors" "--cluster $W/c1"; do
    # shellcheck disable=SC2086
    out=$("$N" train $where --data "$W/data.txt" --steps 2 --batch 2 --seq 16 $a 2>&1); rc=$?
    check test $rc -eq 1
    check grep -qF -- "${a%% *} /proc" <<< "$out"
    check grep -qF "cannot write in /proc: the file system takes no new files there" <<< "$out"
    check test "$(grep -c '^step\|loss' <<< "$out")" -eq 0
  done
done
# 5: a wrong --coordinator-key, a key not in authorized_keys, the secret
# coordinator.key as --coordinator-key, a dead port: each at once, each its own
out=$(fast 5 "$N" status --coordinator "$EP" --key "$W/c1/client.key" --coordinator-key "$W/other.pub" --timeout 30 2>&1); rc=$?
check test $rc -eq 1
check grep -q "closed the connection during the handshake: --coordinator-key is not its public key" <<< "$out"
out=$(fast 5 "$N" status --coordinator "$EP" --key "$W/other.key" --coordinator-key "$W/c1/coord/coordinator.pub" --timeout 30 2>&1); rc=$?
check test $rc -eq 1
check grep -q "refused this key .*authorized_keys" <<< "$out"
out=$(fast 5 "$N" status --coordinator "$EP" --key "$W/c1/client.key" --coordinator-key "$W/c1/coord/coordinator.key" --timeout 30 2>&1); rc=$?
check test $rc -eq 1
check grep -q "coordinator.key holds a secret key where a public one is expected" <<< "$out"
out=$(fast 5 "$N" status --coordinator tcp://127.0.0.1:1 "${K[@]}" --timeout 30 2>&1); rc=$?
check test $rc -eq 1
check grep -q "connection refused" <<< "$out"
out=$(fast 5 "$N" status --coordinator "$EP" --plaintext --timeout 30 2>&1); rc=$?
check test $rc -eq 1
check grep -q "ended the handshake: it expects CURVE keys, and this client is --plaintext" <<< "$out"
# the same refused key from a node: said at once, not after 30 s of "not answering"
out=$(fast 10 timeout 20 "$NODE" join "$EPN" --key "$W/other.key" --coordinator-key "$W/c1/coord/coordinator.pub" \
  --memory 256M --threads 1 2>&1); rc=$?
check test $rc -ne 0
check grep -q "refused this key" <<< "$out"
out=$(fast 10 timeout 20 "$NODE" join "$EPN" --key "$W/other.key" --coordinator-key "$W/other.pub" \
  --memory 256M --threads 1 2>&1); rc=$?
check test $rc -ne 0
check grep -q "closed the connection during the handshake: --coordinator-key is not its public key" <<< "$out"
# 7: a public key given as the secret
out=$("$N" status --coordinator "$EP" --key "$W/c1/client.pub" --coordinator-key "$W/c1/coord/coordinator.pub" 2>&1)
check grep -q "client.pub is a public key" <<< "$out"
# 11: an endpoint without its transport
out=$("$N" status --coordinator 127.0.0.1:17001 "${K[@]}" 2>&1)
check grep -qF "give a ZeroMQ endpoint, e.g. tcp://127.0.0.1:17001" <<< "$out"
# 4: after cluster down, clients fail at once
check "$N" cluster down --dir "$W/c1"
out=$(fast 5 "$N" status --cluster "$W/c1" --timeout 10 2>&1); rc=$?
check test $rc -eq 1
check grep -qF "the cluster in $W/c1 is not running (neuroctl cluster up" <<< "$out"
out=$(fast 5 "$N" train --cluster "$W/c1" --data "$W/data.txt" --steps 2 --timeout 10 2>&1); rc=$?
check test $rc -eq 1
check grep -q "is not running" <<< "$out"
check test ! -e "$W/c1/coord/endpoint"
check test ! -e "$W/c1/coord/client_endpoint"

# ---- 6. cluster up shows the coordinator's error at once ----
{ cat "$W/cfg.yaml"; echo "num_expert: 4"; } > "$W/typo.yaml"
out=$(fast 8 "$N" cluster up --dir "$W/c2" --nodes 1 --config "$W/typo.yaml" --memory 512M --threads 1 2>&1); rc=$?
check test $rc -eq 1
check grep -q "the coordinator exited with status .*typo.yaml:10: unknown key 'num_expert'" <<< "$out"
check test "$(grep -c 'stopped 0' <<< "$out")" -eq 0

echo "test_cli_nolost: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
