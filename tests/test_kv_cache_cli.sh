#!/usr/bin/env bash
# --kv-cache on every path that decodes, as real processes: a value other
# than fp32 or bf16 is a usage error naming the allowed values (neuroctl
# generate, neuroctl serve, neuroctl bench, neuronode join; bench --kv-cache
# bf16 runs and its JSON says kv_cache bf16), and neuroctl generate's
# greedy ids over 40 tokens with --kv-cache bf16 equal --kv-cache fp32's and
# the default's on a small random model, and neuroctl serve --kv-cache bf16
# says so in /api/status and completes, and a local cluster's nodes take it
# from cluster up and generate the local ids (NL_TEST_DEVICE: cpu by
# default).
set -uo pipefail
NEUROCTL="$NL_BUILD_DIR/cli/neuroctl"
DEV=(--device "${NL_TEST_DEVICE:-cpu}")
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }
check() { if "$@"; then ok; else bad "$*"; fi; }

cat > "$W/cfg.yaml" <<'YAML'
hidden_dim: 64
num_layers: 2
num_heads: 4
num_kv_heads: 2
ffn_dim: 64
num_experts: 4
vocab_size: 256
vocab_chunk: 256
max_seq_len: 128
YAML
check "$NEUROCTL" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 3

out=$("$NEUROCTL" generate "${DEV[@]}" --kv-cache fp16 --model "$W/m.safetensors" --prompt-tokens 1,2 2>&1); rc=$?
check test "$rc" = 2
check grep -q "kv-cache fp16: not fp32 or bf16" <<<"$out"
out=$("$NEUROCTL" serve "${DEV[@]}" --kv-cache int8 --model "$W/m.safetensors" 2>&1); rc=$?
check test "$rc" = 2
check grep -q "kv-cache int8: not fp32 or bf16" <<<"$out"
out=$("$NL_BUILD_DIR/node/neuronode" join tcp://127.0.0.1:1 --plaintext --memory 1G --kv-cache BF16 2>&1); rc=$?
check test "$rc" = 2
check grep -q "kv-cache BF16: not fp32 or bf16" <<<"$out"
out=$("$NEUROCTL" bench "${DEV[@]}" --kv-cache fp8 --config "$W/cfg.yaml" 2>&1); rc=$?
check test "$rc" = 2
check grep -q "kv-cache fp8: not fp32 or bf16" <<<"$out"
out=$("$NEUROCTL" bench "${DEV[@]}" --kv-cache bf16 --config "$W/cfg.yaml" --batch 1 --seq 8 --decode-tokens 4 --repeats 1 2>&1); rc=$?
check test "$rc" = 0
check grep -q '"kv_cache":"bf16"' <<<"$out"
check grep -q '"decode_tokens":4,' <<<"$out"
# more decode tokens than fit after the 16-token prompt in max_seq_len 128:
# the ones that fit, said on stderr and in the JSON
out=$("$NEUROCTL" bench "${DEV[@]}" --config "$W/cfg.yaml" --batch 1 --seq 8 --decode-tokens 500 --repeats 1 2>&1); rc=$?
check test "$rc" = 0
check grep -q "decode-tokens 500: 112 fit after the 16-token prompt in max_seq_len 128" <<<"$out"
check grep -q '"decode_tokens":112,' <<<"$out"
for cmd in generate serve bench; do
    check grep -q -- "--kv-cache" <<<"$("$NEUROCTL" "$cmd" --help 2>&1)"
done
check grep -q -- "--kv-cache" <<<"$("$NL_BUILD_DIR/node/neuronode" join --help 2>&1)"

gen() {
    "$NEUROCTL" generate "${DEV[@]}" --model "$W/m.safetensors" --prompt-tokens 5,17,200,3,99,42 \
        --max-new 40 --temperature 0 "$@" 2> "$W/gen.err" | head -1
}
ids_default=$(gen)
ids32=$(gen --kv-cache fp32)
ids16=$(gen --kv-cache bf16)
check test -n "$ids32"
check test "$(wc -w <<<"$ids16")" = 40
check test "$ids_default" = "$ids32"
if [ "$ids16" = "$ids32" ]; then ok; else bad "bf16 cache ids '$ids16' differ from FP32's '$ids32'"; fi

# serve with a bf16 cache: /api/status says so and a completion runs
"$NEUROCTL" serve "${DEV[@]}" --kv-cache bf16 --model "$W/m.safetensors" --http 127.0.0.1:0 \
    > "$W/serve.out" 2> "$W/serve.err" &
spid=$!
url=""
for _ in $(seq 1 600); do # up to a minute on a busy machine
    url=$(sed -n 's/.* on \(http:[^ ]*\) .*/\1/p' "$W/serve.out")
    [ -n "$url" ] || ! kill -0 "$spid" 2> /dev/null && break
    sleep 0.1
done
check test -n "$url"
if [ -n "$url" ]; then
    check grep -q '"kv_cache":"bf16"' <<<"$(curl -s "${url}api/status")"
    out=$(curl -s -w ' HTTP %{http_code}' "${url}v1/completions" -H 'Content-Type: application/json' \
        -d '{"prompt":"the quick","max_tokens":8,"temperature":0}')
    check grep -q '"choices".* HTTP 200$' <<<"$out"
fi
kill "$spid" 2> /dev/null
wait "$spid"

# a local cluster's nodes with bf16 caches (cluster up --kv-cache bf16, passed
# to neuronode join): each node says so, and its greedy ids are the local
# ones with the same cache (CPU nodes: not where the device under test is
# a GPU)
out=$("$NEUROCTL" cluster up --dir "$W/cl0" --kv-cache fp16 --model "$W/m.safetensors" 2>&1); rc=$?
check test "$rc" = 2
check grep -q "kv-cache fp16: not fp32 or bf16" <<<"$out"
if [[ "${DEV[1]}" != cuda:* ]]; then
    if "$NEUROCTL" cluster up --dir "$W/cl" --nodes 2 --threads 1 --kv-cache bf16 \
        --model "$W/m.safetensors" --timeout 60 > "$W/up.out" 2>&1; then
        ok
        check grep -q "bf16 caches" "$W/cl/node-1.log"
        check grep -q "bf16 caches" "$W/cl/node-2.log"
        idsc=$("$NEUROCTL" generate --cluster "$W/cl" --prompt-tokens 5,17,200,3,99,42 \
            --max-new 40 --temperature 0 2> "$W/genc.err" | head -1)
        if [ "$idsc" = "$ids16" ]; then ok; else bad "cluster ids '$idsc' (bf16 caches) differ from local '$ids16': $(cat "$W/genc.err")"; fi
        "$NEUROCTL" cluster down --dir "$W/cl" > /dev/null 2>&1
    else
        bad "cluster up --kv-cache bf16: $(cat "$W/up.out")"
    fi
fi

echo "test_kv_cache_cli: $pass passed, $fail failed"
[ "$fail" = 0 ]
