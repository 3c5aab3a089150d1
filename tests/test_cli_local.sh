#!/usr/bin/env bash
# Integration test of neuroctl's local tools as real processes: init,
# forward, generate, grad, train with resume (bit-identical), export of a
# sharded checkpoint, the non-finite guard through its test hook, and
# clear errors on bad input (also those of train with a cluster named:
# usage errors, and no cluster there).
set -uo pipefail
NEUROCTL="$NL_BUILD_DIR/cli/neuroctl"
# the device of the local tools and the nodes (scripts/test.sh runs the suite
# once more with NL_TEST_DEVICE=cpu-devsim)
DEV=(--device "${NL_TEST_DEVICE:-cpu}")
SRC="$NL_SOURCE_DIR"
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }
check() { if "$@"; then ok; else bad "$*"; fi; }

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
check "$NEUROCTL" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 3

# data: a repetitive text so a tiny model can learn
for i in $(seq 1 200); do echo "the quick brown fox $i jumps over the lazy dog"; done > "$W/data.txt"

# generate: greedy twice gives the same ids; ids are in the vocabulary
a=$("$NEUROCTL" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 116,104,101 --max-new 8 --temperature 0 | head -1)
b=$("$NEUROCTL" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 116,104,101 --max-new 8 --temperature 0 | head -1)
check test "$a" = "$b"
check test "$(echo "$a" | wc -w)" -eq 8
# --warmup runs the prompt once first: the same ids; the pace on stderr
b=$("$NEUROCTL" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 116,104,101 --max-new 8 --temperature 0 --warmup 2>"$W/gen.err" | head -1)
check test "$a" = "$b"
check grep -q "^generate: 8 tokens: first after .* ms, then 7 in .* ms (.* tokens/s)" "$W/gen.err"

# train 20 straight vs 10 + resume + 10: bit-identical weights and moments
common=(--data "$W/data.txt" --steps 20 --batch 4 --seq 16 --microbatches 2 --lr 1e-3 --seed 5 --threads 2)
check "$NEUROCTL" train "${DEV[@]}" --model "$W/m.safetensors" "${common[@]}" --out "$W/straight.safetensors" --log "$W/straight.jsonl"
check "$NEUROCTL" train "${DEV[@]}" --model "$W/m.safetensors" "${common[@]}" --checkpoint-every 10 --checkpoint-dir "$W/ck" --out "$W/unused.safetensors"
check test -s "$W/ck/step-000010.safetensors"
check "$NEUROCTL" train "${DEV[@]}" --resume "$W/ck/step-000010.safetensors" "${common[@]}" --out "$W/resumed.safetensors"
check cmp "$W/straight.safetensors" "$W/resumed.safetensors"
check test "$(wc -l < "$W/straight.jsonl")" -eq 20
first=$(head -1 "$W/straight.jsonl" | sed 's/.*"loss":\([0-9.e+-]*\).*/\1/')
last=$(tail -1 "$W/straight.jsonl" | sed 's/.*"loss":\([0-9.e+-]*\).*/\1/')
check awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }'

# export: the trained checkpoint cut into 2 shards + a manifest, as a distributed
# run writes them (tests/make_shards.c), joins back into the same file byte for byte
mkdir -p "$W/shards"
check "$NL_BUILD_DIR/tests/make_shards" "$W/straight.safetensors" "$W/shards" 1
check "$NEUROCTL" export --manifest "$W/shards" --out "$W/joined.safetensors"
check cmp "$W/straight.safetensors" "$W/joined.safetensors"
python3 -c 'import sys; p = sys.argv[1]; b = bytearray(open(p, "rb").read()); b[len(b) // 2] ^= 1; open(p, "wb").write(b)' "$W/shards/stage-1.safetensors"
out=$("$NEUROCTL" export --manifest "$W/shards/manifest.json" --out "$W/corrupt.safetensors" 2>&1); rc=$?
check test $rc -eq 1
check grep -q "stage-1.safetensors (stage 1): sha256 mismatch.*(NL_ERR_INTEGRITY)" <<< "$out"
check test ! -e "$W/corrupt.safetensors"
"$NEUROCTL" export --manifest "$W/shards" >/dev/null 2>&1
check test $? -eq 2
"$NEUROCTL" export --manifest "$W/shards" --out "$W/x.safetensors" --frob >/dev/null 2>&1
check test $? -eq 2
check "$NEUROCTL" export --help

# eval loss appears where asked
check "$NEUROCTL" train "${DEV[@]}" --model "$W/m.safetensors" --data "$W/data.txt" --steps 4 --batch 2 --seq 16 --eval-every 2 --log "$W/eval.jsonl" --threads 2 --out "$W/eval.safetensors"
check test "$(grep -c '"eval_loss"' "$W/eval.jsonl")" -eq 2

# the non-finite guard: step 2 gets a NaN gradient, is skipped, the run goes on
NL_TEST_INJECT_NAN_STEP=1 "$NEUROCTL" train "${DEV[@]}" --model "$W/m.safetensors" --data "$W/data.txt" --steps 3 --batch 2 --seq 16 --log "$W/nan.jsonl" --out "$W/nan.safetensors" --threads 2 2> "$W/nan.err"
check test $? -eq 0
check grep -q '"step":2,.*"skipped":true' "$W/nan.jsonl"
check grep -q '"step":3,.*"skipped":false' "$W/nan.jsonl"
check grep -q 'step skipped' "$W/nan.err"

# grad writes every weight and the losses
printf '' > /dev/null
python3 - "$W" <<'PY' || bad "make batch file"
import json, struct, sys
w = sys.argv[1]
def save(path, tensors):
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data); off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    open(path, "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
toks = [1, 2, 3, 4, 5, 6]
save(w + "/batch.safetensors", {
    "tokens": ("I64", [2, 3], struct.pack("<6q", *toks)),
    "targets": ("I32", [2, 3], struct.pack("<6i", *[t + 1 for t in toks])),
})
save(w + "/bad_tokens.safetensors", {"tokens": ("I64", [1, 2], struct.pack("<2q", 5, 999))})
PY
check "$NEUROCTL" grad "${DEV[@]}" --model "$W/m.safetensors" --batch "$W/batch.safetensors" --out "$W/g.safetensors"
check "$NEUROCTL" forward "${DEV[@]}" --model "$W/m.safetensors" --tokens "$W/batch.safetensors" --out "$W/f.safetensors"

# bad input: clear errors that name the fault, exit code 1 or 2, no crash
out=$("$NEUROCTL" forward "${DEV[@]}" --model "$W/m.safetensors" --tokens "$W/bad_tokens.safetensors" --out "$W/x.safetensors" 2>&1); rc=$?
check test $rc -eq 1
check grep -q "token 999" <<< "$out"
# --out that is the --tokens input: refused before the input is overwritten
sum_in=$(sha256sum < "$W/batch.safetensors")
out=$("$NEUROCTL" forward "${DEV[@]}" --model "$W/m.safetensors" --tokens "$W/batch.safetensors" --out "$W/./batch.safetensors" 2>&1); rc=$?
check test "$rc" -eq 1
check grep -qF "that is the --tokens input" <<<"$out"
check test "$(sha256sum < "$W/batch.safetensors")" = "$sum_in"
out=$("$NEUROCTL" forward "${DEV[@]}" --model "$W/nope.safetensors" --tokens "$W/batch.safetensors" --out "$W/x.safetensors" 2>&1); rc=$?
check test $rc -eq 1
check grep -q "nope.safetensors" <<< "$out"
head -c 100 "$W/m.safetensors" > "$W/trunc.safetensors"
out=$("$NEUROCTL" generate "${DEV[@]}" --model "$W/trunc.safetensors" --prompt-tokens 1 --max-new 2 2>&1); rc=$?
check test $rc -eq 1
check grep -q "trunc.safetensors" <<< "$out"
"$NEUROCTL" train "${DEV[@]}" --model "$W/m.safetensors" --data "$W/data.txt" --steps 2 --batch 3 --microbatches 2 >/dev/null 2>&1
check test $? -eq 2
"$NEUROCTL" frobnicate >/dev/null 2>&1
check test $? -eq 2
# an unknown flag or command comes with the closest known one, or with none
# when none is close (issue 34)
out=$("$NEUROCTL" generate --model "$W/m.safetensors" --prompt-tokens 1 --max-tokens 5 2>&1); rc=$?
check test $rc -eq 2
check grep -qF "unknown flag '--max-tokens': did you mean --max-new?" <<< "$out"
out=$("$NEUROCTL" train --model "$W/m.safetensors" --data "$W/data.txt" --step 3 2>&1); rc=$?
check test $rc -eq 2
check grep -qF "unknown flag '--step': did you mean --steps?" <<< "$out"
out=$("$NEUROCTL" serve --model "$W/m.safetensors" --port 8080 2>&1); rc=$?
check test $rc -eq 2
check grep -qF "unknown flag '--port': did you mean --http?" <<< "$out"
out=$("$NEUROCTL" generate --model "$W/m.safetensors" --port 8080 2>&1); rc=$?
check test $rc -eq 2
check grep -qF "unknown flag '--port' (see --help)" <<< "$out"
out=$("$NEUROCTL" tokenizer encode --tokenizr x 2>&1); rc=$?
check test $rc -eq 2
check grep -qF "unknown option '--tokenizr': did you mean --tokenizer?" <<< "$out"
out=$("$NEUROCTL" trian 2>&1); rc=$?
check test $rc -eq 2
check grep -qF "unknown command 'trian': did you mean train?" <<< "$out"
# the version, one line, exit 0; help COMMAND is that command's own usage
out=$("$NEUROCTL" --version); rc=$?
check test $rc -eq 0
check grep -qE '^neuroctl [0-9]+\.[0-9]+\.[0-9]+( \(git [^)]+\))?$' <<< "$out"
check test "$("$NEUROCTL" version)" = "$out"
out=$("$NEUROCTL" help train); rc=$?
check test $rc -eq 0
check grep -q "^usage: neuroctl train --model" <<< "$out"
check test "$out" = "$("$NEUROCTL" train --help)"
"$NEUROCTL" help frobnicate >/dev/null 2>&1
check test $? -eq 2
"$NEUROCTL" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 1,x >/dev/null 2>&1
check test $? -eq 2

# train with a cluster: the local-only flags are refused with the reason,
# local training's checks hold, and no cluster at the directory (or
# nothing answering at its endpoint) fails cleanly within --timeout
out=$("$NEUROCTL" train --cluster "$W/nocluster" --model "$W/m.safetensors" --data "$W/data.txt" --steps 2 2>&1); rc=$?
check test $rc -eq 2
check grep -qF -- "--model: a cluster trains its own model (start the coordinator with --model)" <<< "$out"
out=$("$NEUROCTL" train --cluster "$W/nocluster" --data "$W/data.txt" --steps 2 --threads 2 2>&1); rc=$?
check test $rc -eq 2
check grep -qF -- "--threads: each node has its own --threads" <<< "$out"
out=$("$NEUROCTL" train --cluster "$W/nocluster" --data "$W/data.txt" --steps 2 --batch 3 --microbatches 2 2>&1); rc=$?
check test $rc -eq 2
check grep -qF -- "--microbatches: 2 does not divide --batch 3" <<< "$out"
out=$("$NEUROCTL" train --cluster "$W/nocluster" --data "$W/data.txt" --steps 2 --eval-every 1 --holdout 0 2>&1); rc=$?
check test $rc -eq 2
"$NEUROCTL" train --cluster "$W/nocluster" --steps 2 >/dev/null 2>&1
check test $? -eq 2
out=$("$NEUROCTL" train --cluster "$W/nocluster" --data "$W/nope.txt" --steps 2 2>&1); rc=$?
check test $rc -eq 1
check grep -q "nope.txt" <<< "$out"
mkdir -p "$W/nocluster"
out=$(cd "$W" && timeout 20 "$NEUROCTL" train --cluster nocluster --data data.txt --steps 2 --timeout 2 2>&1); rc=$?
check test $rc -eq 1
check grep -q "the cluster in nocluster is not running (neuroctl cluster up" <<< "$out"
check test ! -e "$W/checkpoints" # the run never started: no directory made
# an endpoint nobody listens on: "connection refused" at once, not a wait
mkdir -p "$W/deadcluster/coord"
"$NEUROCTL" keygen --out "$W/deadcluster/client" >/dev/null 2>&1
"$NEUROCTL" keygen --out "$W/deadcluster/coord/coordinator" >/dev/null 2>&1
out=$(timeout 20 "$NEUROCTL" train --coordinator "ipc://$W/deadcluster/nothing.sock" \
  --key "$W/deadcluster/client.key" --coordinator-key "$W/deadcluster/coord/coordinator.pub" \
  --data "$W/data.txt" --steps 2 --timeout 10 2>&1); rc=$?
check test $rc -eq 1
check grep -q "connection refused.*(NL_ERR_IO)" <<< "$out"

echo "test_cli_local: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
