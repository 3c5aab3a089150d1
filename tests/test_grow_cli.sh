#!/usr/bin/env bash
# neuroctl grow as real processes (DESIGN 5): a trained checkpoint grows in
# depth (logits bit-identical) and width (within 1e-5), its history is
# kept in the metadata across further growth and training, a resume across
# a growth trains; a sharded checkpoint grows by manifest and exports the
# same model; bad requests are refused by name; and nlref (PyTorch) agrees
# with the grown checkpoints (tests/golden/check_grow.py).
set -uo pipefail
N="$NL_BUILD_DIR/cli/neuroctl"
DEV=(--device "${NL_TEST_DEVICE:-cpu}")
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
pass=0
fail=0
check() { if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $*" >&2; fi; }

for i in $(seq 1 200); do echo "the cat sat on the mat number $i, and the dog sat too."; done > "$W/a.txt"
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
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 4
check "$N" train "${DEV[@]}" --model "$W/m.safetensors" --data "$W/a.txt" --steps 3 --batch 2 \
    --seq 16 --out "$W/t.safetensors" --threads 2
python3 - "$W/tok.safetensors" <<'PY'
import json, struct, sys
n = 2 * 12
hdr = json.dumps({"tokens": {"dtype": "I32", "shape": [2, 12], "data_offsets": [0, 4 * n]}}).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(hdr)) + hdr + struct.pack("<%di" % n, *[(i * 37) % 256 for i in range(n)]))
PY
fwd() { "$N" forward "${DEV[@]}" --model "$1" --tokens "$W/tok.safetensors" --out "$2" --threads 2; }
check fwd "$W/t.safetensors" "$W/l0.safetensors"

# depth, then width on top (and F)
out=$("$N" grow --model "$W/t.safetensors" --out "$W/d.safetensors" --layers 4)
check test $? -eq 0
check grep -q "depth 2 -> 4 layers at step 3" <<< "$out"
check grep -q "optimizer state too" <<< "$out"
check fwd "$W/d.safetensors" "$W/l1.safetensors"
out=$("$N" grow --model "$W/d.safetensors" --out "$W/w.safetensors" --hidden-dim 64 --ffn-dim 48)
check test $? -eq 0
check grep -q "width hidden_dim 32 -> 64, heads 2/1 -> 4/2, ffn_dim 32 -> 48 at step 3" <<< "$out"
check fwd "$W/w.safetensors" "$W/l2.safetensors"
python3 - "$W" <<'PY' || { fail=$((fail + 1)); echo "FAIL: grown logits and history" >&2; }
import json, struct, sys
def read(path):
    f = open(path, "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n)); body = f.read()
    return h, body
def logits(path):
    h, body = read(path); e = h["logits"]; a, b = e["data_offsets"]
    return struct.unpack("<%df" % ((b - a) // 4), body[a:b])
W = sys.argv[1]
l0, l1, l2 = (logits(W + "/l%d.safetensors" % i) for i in range(3))
assert l0 == l1, "depth growth changed the logits"
worst = max(abs(a - b) for a, b in zip(l0, l2)) / max(abs(a) for a in l0)
assert worst < 1e-5, worst
h, _ = read(W + "/w.safetensors")
hist = json.loads(h["__metadata__"]["growth"])
assert [e["kind"] for e in hist] == ["depth", "width"], hist
assert hist[0]["step"] == 3 and hist[0]["adam_steps"] == 3, hist[0]
assert hist[1]["before"]["num_layers"] == 4 and hist[1]["after"]["hidden_dim"] == 64, hist[1]
assert "optim.m.layers.3.attention.wo.weight" in h
PY

# a resume across the growth trains, and keeps the history
check "$N" train "${DEV[@]}" --resume "$W/w.safetensors" --data "$W/a.txt" --steps 6 --batch 2 \
    --seq 16 --out "$W/w2.safetensors" --threads 2
python3 - "$W/w2.safetensors" <<'PY' || { fail=$((fail + 1)); echo "FAIL: history after training" >&2; }
import json, struct, sys
f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]; meta = json.loads(f.read(n))["__metadata__"]
assert [e["kind"] for e in json.loads(meta["growth"])] == ["depth", "width"]
assert meta["step"] == "6", meta["step"]
PY

# refused by name: whole heads, the kv ratio, shrinking, nothing to grow
"$N" grow --model "$W/t.safetensors" --out "$W/x.safetensors" --hidden-dim 40 2> "$W/err"
check test $? -eq 1
check grep -q "not a multiple of the head dim 16" "$W/err"
"$N" grow --model "$W/t.safetensors" --out "$W/x.safetensors" --hidden-dim 48 2> "$W/err"
check test $? -eq 1
check grep -q "cannot keep the ratio" "$W/err"
"$N" grow --model "$W/d.safetensors" --out "$W/x.safetensors" --layers 3 2> "$W/err"
check test $? -eq 1
check grep -q "num_layers: 3 is below the current 4" "$W/err"
"$N" grow --model "$W/t.safetensors" --out "$W/x.safetensors" --layers 2 2> "$W/err"
check test $? -eq 1
check grep -q "nothing to grow" "$W/err"
"$N" grow --model "$W/t.safetensors" --out "$W/x.safetensors" 2> /dev/null
check test $? -eq 2
"$N" grow --model "$W/t.safetensors" --manifest "$W" --out "$W/x" --layers 3 2> /dev/null
check test $? -eq 2
check test ! -e "$W/x.safetensors"

# a sharded checkpoint grows by manifest: into the same directory, then another
mkdir -p "$W/shards"
check "$NL_BUILD_DIR/tests/make_shards" "$W/t.safetensors" "$W/shards" 1
out=$("$N" grow --manifest "$W/shards" --out "$W/other" --layers 4 --force 2>&1); rc=$?
check test "$rc" -eq 2 # --force goes with --model: a grown set's files are never replaced
check grep -qF -- "--force goes with --model" <<<"$out"
check test ! -e "$W/other"
out=$("$N" grow --manifest "$W/shards" --out "$W/shards" --layers 4)
check test $? -eq 0
check grep -q "wrote $W/shards/manifest-grow1.json" <<< "$out"
check "$N" export --manifest "$W/shards/manifest-grow1.json" --out "$W/e.safetensors"
check fwd "$W/e.safetensors" "$W/l3.safetensors"
check cmp -s "$W/l1.safetensors" "$W/l3.safetensors" # the same logits, bit for bit
out=$("$N" grow --manifest "$W/shards/manifest-grow1.json" --out "$W/wide" --hidden-dim 64 \
    --ffn-dim 48)
check test $? -eq 0
check test -f "$W/wide/manifest.json"
check "$N" export --manifest "$W/wide" --out "$W/e2.safetensors"
python3 - "$W/e2.safetensors" "$W/w.safetensors" <<'PY' || { fail=$((fail + 1)); echo "FAIL: manifest growth = file growth" >&2; }
import json, struct, sys
def read(path):
    f = open(path, "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n)); return h, f.read()
(ha, a), (hb, b) = read(sys.argv[1]), read(sys.argv[2])
for k, e in hb.items():
    if k == "__metadata__":
        continue
    x, y = ha[k]["data_offsets"], e["data_offsets"]
    assert a[x[0]:x[1]] == b[y[0]:y[1]], k  # the same weights and moments, bit for bit
ma, mb = ha["__metadata__"], hb["__metadata__"]
assert json.loads(ma["growth"]) == json.loads(mb["growth"])
assert json.loads(ma["config"]) == json.loads(mb["config"])
PY

# nlref (PyTorch, written from DESIGN only) on checkpoints the C tool grew
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
    mkdir -p "$W/golden"
    check /usr/bin/python3 "$NL_SOURCE_DIR/tests/golden/check_grow.py" "$N" "$W/golden"
else
    echo "check_grow.py skipped: no python3-torch"
fi

echo "test_grow_cli: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
