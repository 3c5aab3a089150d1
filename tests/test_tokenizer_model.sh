#!/usr/bin/env bash
# The tokenizer with a model, as real processes: a checkpoint carries its
# tokenizer; train reads text through it; generate takes --prompt text;
# the tokenizer learns more merges and the model's tables grow with it
# (by checkpoint), keeping old rows, and training goes on.
set -uo pipefail
N="$NL_BUILD_DIR/cli/neuroctl"
# the device of the local tools and the nodes (scripts/test.sh runs the suite
# once more with NL_TEST_DEVICE=cpu-devsim)
DEV=(--device "${NL_TEST_DEVICE:-cpu}")
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
pass=0
fail=0
check() { if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $*" >&2; fi; }

for i in $(seq 1 300); do echo "the cat sat on the mat number $i, and the dog sat too."; done > "$W/a.txt"
for i in $(seq 1 300); do echo "quantum chromodynamics describes gluons $((i * 7))"; done > "$W/b.txt"
cat > "$W/cfg.yaml" <<'YAML'
hidden_dim: 32
num_layers: 2
num_heads: 2
num_kv_heads: 1
ffn_dim: 32
num_experts: 4
vocab_chunk: 256
max_seq_len: 64
YAML
check "$N" tokenizer train --input "$W/a.txt" --vocab-size 300 --out "$W/tok" --quiet
check "$N" init --config "$W/cfg.yaml" --tokenizer "$W/tok" --out "$W/m.safetensors" --seed 4
python3 - "$W/m.safetensors" <<'PY' || { fail=$((fail + 1)); echo "FAIL: metadata" >&2; }
import json, struct, sys
f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n))
meta = h["__metadata__"]
assert meta["tokenizer"].startswith("neurollm-bpe 2\nsplit unicode\n"), meta.keys()
assert json.loads(meta["config"])["vocab_size"] == 300
assert h["tok_embeddings.weight"]["shape"] == [512, 32]  # ceil(300/256)*256
PY
check "$N" train "${DEV[@]}" --model "$W/m.safetensors" --data "$W/a.txt" --steps 3 --batch 2 --seq 16 --out "$W/t.safetensors" --threads 2
out=$("$N" generate "${DEV[@]}" --model "$W/t.safetensors" --prompt "the cat" --max-new 5 --temperature 0 --threads 2)
check test "${out:0:7}" = "the cat"

# learn from new text: ids grow past the capacity (300 -> more than 512)
check "$N" tokenizer learn --tokenizer "$W/tok" --input "$W/b.txt" --add 300 --out "$W/tok2" --min-count 1 --quiet
v2=$("$N" tokenizer info --tokenizer "$W/tok2" | awk '/^vocab_size/ {print $2}')
check test "$v2" -gt 512
check "$N" grow --model "$W/t.safetensors" --tokenizer "$W/tok2" --out "$W/g.safetensors"
python3 - "$W/t.safetensors" "$W/g.safetensors" <<'PY' || { fail=$((fail + 1)); echo "FAIL: growth kept old rows" >&2; }
import json, struct, sys
def load(p):
    f = open(p, "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n)); base = 8 + n
    data = open(p, "rb").read()
    return h, lambda k: data[base + h[k]["data_offsets"][0]: base + h[k]["data_offsets"][1]]
h1, t1 = load(sys.argv[1]); h2, t2 = load(sys.argv[2])
for k in ("tok_embeddings.weight", "lm_head.weight", "optim.m.lm_head.weight", "optim.v.tok_embeddings.weight"):
    a, b = t1(k), t2(k)
    assert len(b) > len(a) and b[:len(a)] == a, k
    if k.startswith("optim"):
        assert set(b[len(a):]) == {0}, k
assert t1("layers.0.attention.wq.weight") == t2("layers.0.attention.wq.weight")
assert h2["__metadata__"]["tokenizer"] != h1["__metadata__"]["tokenizer"]
PY
check "$N" train "${DEV[@]}" --resume "$W/g.safetensors" --data "$W/b.txt" --steps 6 --batch 2 --seq 16 --threads 2 --out "$W/g2.safetensors"
out=$("$N" generate "${DEV[@]}" --model "$W/g2.safetensors" --prompt "quantum" --max-new 4 --temperature 0 --threads 2)
check test "${out:0:7}" = "quantum"
# a tokenizer that does not extend the model's is refused
check "$N" tokenizer train --input "$W/b.txt" --vocab-size 320 --out "$W/other" --quiet
"$N" grow --model "$W/t.safetensors" --tokenizer "$W/other" --out "$W/x.safetensors" 2> "$W/err"
check test $? -eq 1
check grep -q "does not extend" "$W/err"

echo "test_tokenizer_model: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
