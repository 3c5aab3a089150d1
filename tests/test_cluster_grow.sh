#!/usr/bin/env bash
# Growth on a live cluster (issue 16), as real processes on loopback.
#  - vocabulary: a 3-node cluster (vocab 300, vocab_chunk 64: capacity 320)
#    trains 4 steps; `neuroctl tokenizer learn --cluster` adds 100 ids
#    (259 -> 359: past one chunk, capacity 384); the logits over the old
#    300 ids are bit-identical before and after; the grown manifest's tables
#    and moments grew on exactly the embedding and head stages (new rows'
#    moments zero, every other tensor unchanged); `neuroctl status` shows
#    the growth; 4 more steps on text with the new ids move a new id's row;
#    `neuroctl train --learn-vocab` grows it again from its own data before
#    it starts, and the client's log has the growth's event line.
set -uo pipefail
N="$NL_BUILD_DIR/cli/neuroctl"
DEV=(--device "${NL_TEST_DEVICE:-cpu}")
export NL_TEST_GFLOPS=20 # equal throughputs: plans do not hang on disturbed probes
W=$(mktemp -d)
cleanup() {
  for c in "$W"/c*; do "$N" cluster down --dir "$c" >/dev/null 2>&1; done
  rm -rf "$W"
}
trap cleanup EXIT
pass=0
fail=0
check() { if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $*" >&2; fi; }
PY=/usr/bin/python3

cat > "$W/st.py" <<'PY'
import json, struct, sys
def tensors(p):
    b = open(p, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    out = {}
    for k, v in h.items():
        if k == "__metadata__": continue
        s, e = v["data_offsets"]; raw = b[8 + n + s: 8 + n + e]
        out[k] = (v["shape"], struct.unpack("<%df" % (len(raw) // 4), raw))
    return out
def shards(mf):
    import os
    m = json.load(open(mf)); d = os.path.dirname(mf)
    return m, [tensors(os.path.join(d, s["file"])) for s in m["shards"]]
what = sys.argv[1]
if what == "tokens":          # tokens OUT ID...: an I32 [1, T] 'tokens' file
    ids = [int(x) for x in sys.argv[3:]]
    h = json.dumps({"tokens": {"dtype": "I32", "shape": [1, len(ids)],
                               "data_offsets": [0, 4 * len(ids)]}}).encode()
    h += b" " * (-len(h) % 8)
    open(sys.argv[2], "wb").write(struct.pack("<Q", len(h)) + h + struct.pack("<%di" % len(ids), *ids))
elif what == "same_old":      # same_old A B V: logits of B over the first V ids == A's, bit for bit
    a, b, V = tensors(sys.argv[2])["logits"], tensors(sys.argv[3])["logits"], int(sys.argv[4])
    Va, Vb = a[0][2], b[0][2]
    assert Va == V and Vb > V, (a[0], b[0])
    rows = a[0][0] * a[0][1]
    for r in range(rows):
        assert a[1][r * Va:(r + 1) * Va] == b[1][r * Vb:r * Vb + V], "row %d differs" % r
    print("old-vocabulary logits bit-identical over %d positions (%d -> %d ids)" % (rows, Va, Vb))
elif what == "grown":         # grown OLD_MANIFEST NEW_MANIFEST OLD_CAP NEW_CAP
    (m0, s0), (m1, s1) = shards(sys.argv[2]), shards(sys.argv[3])
    c0, c1 = int(sys.argv[4]), int(sys.argv[5])
    assert len(s0) == len(s1) == 3, (len(s0), len(s1))
    grown = []
    for i, (a, b) in enumerate(zip(s0, s1)):
        assert sorted(a) == sorted(b), i
        for k in a:
            (sa, va), (sb, vb) = a[k], b[k]
            base = k.split("optim.m.")[-1].split("optim.v.")[-1]
            if base in ("tok_embeddings.weight", "lm_head.weight"):
                d = sa[1]
                assert sa == [c0, d] and sb == [c1, d], (i, k, sa, sb)
                assert vb[:c0 * d] == va, (i, k, "old rows changed")
                if k.startswith("optim."):
                    assert all(x == 0.0 for x in vb[c0 * d:]), (i, k, "new moments not zero")
                else:
                    assert any(x != 0.0 for x in vb[c0 * d:]), (i, k, "new rows not drawn")
                grown.append((i, k))
            else:
                assert sa == sb and va == vb, (i, k, "changed")
    stages = sorted(set(i for i, _ in grown))
    assert stages == [0, 2], stages
    assert len(grown) == 6, grown   # two tables, each with its two moments
    assert m1["config"]["vocab_size"] > m0["config"]["vocab_size"]
    print("tables and moments grown on stages %s only: %s" % (stages, [k for _, k in grown]))
elif what == "moved":         # moved A_MANIFEST B_MANIFEST ROW: the embedding row ROW changed
    (_, a), (_, b) = shards(sys.argv[2]), shards(sys.argv[3])
    r = int(sys.argv[4])
    sa, va = a[0]["tok_embeddings.weight"]; _, vb = b[0]["tok_embeddings.weight"]
    d = sa[1]
    delta = max(abs(x - y) for x, y in zip(va[r * d:(r + 1) * d], vb[r * d:(r + 1) * d]))
    assert delta > 0, "row %d did not move" % r
    print("row %d moved by up to %.3g" % (r, delta))
PY

cat > "$W/cfg.yaml" <<'YAML'
hidden_dim: 32
num_layers: 6
num_heads: 4
num_kv_heads: 2
ffn_dim: 48
num_experts: 4
vocab_size: 300
vocab_chunk: 64
max_seq_len: 64
YAML
# byte text to start with; new text (other documents) to learn from
cat "$NL_SOURCE_DIR"/README.md > "$W/data.txt"
cat "$NL_SOURCE_DIR"/docs/cluster.md "$NL_SOURCE_DIR"/docs/training.md > "$W/new.txt"
cat "$NL_SOURCE_DIR"/docs/model.md "$NL_SOURCE_DIR"/docs/protocol.md > "$W/more.txt"
RUN=(--batch 4 --seq 32 --microbatches 2 --lr 3e-3 --seed 1)

C="$W/c3"
check "$N" cluster up "${DEV[@]}" --dir "$C" --nodes 3 --config "$W/cfg.yaml" --seed 5 --memory 64M \
  --threads 1 --node-timeout-ms 3000 --timeout 60
check "$N" train --cluster "$C" --data "$W/data.txt" --steps 4 "${RUN[@]}" --checkpoint-dir "$W/ck" \
  2> "$W/train1.err"
check grep -q "on 3 pipeline stages" "$W/train1.err"
M1="$W/ck/step-000004/manifest.json"
check test -f "$M1"

# ---- the tokenizer learns 100 ids on the cluster: past one chunk ----
$PY "$W/st.py" tokens "$W/ids.safetensors" 72 101 108 108 111 32 119 111 114 108 100 10 84 104 101 32
check "$N" forward --cluster "$C" --tokens "$W/ids.safetensors" --out "$W/before.safetensors"
check "$N" tokenizer learn --cluster "$C" --input "$W/new.txt" --add 100 --out "$W/tok.json" \
  2> "$W/learn.err"
cat "$W/learn.err"
check grep -q "vocabulary 300 -> 359 (tokenizer 259 -> 359 ids)" "$W/learn.err"
check grep -q '^merges 100$' "$W/tok.json"
M2=$(sed -n 's/^the cluster.s model is now //p' "$W/learn.err")
check test -f "$M2"
"$N" status --cluster "$C" > "$W/status.txt"
cat "$W/status.txt"
check grep -q "last growth: vocab at step 4: vocab 300 -> 359" "$W/status.txt"
check grep -q "vocab 359" "$W/status.txt"
check "$N" forward --cluster "$C" --tokens "$W/ids.safetensors" --out "$W/after.safetensors"
check $PY "$W/st.py" same_old "$W/before.safetensors" "$W/after.safetensors" 300
check $PY "$W/st.py" grown "$M1" "$M2" 320 384

# ---- training goes on with the new ids: a new id's row moves ----
"$N" tokenizer encode --tokenizer "$W/tok.json" --input "$W/new.txt" > "$W/new.ids"
row=$(tr -s ' \n' '\n' < "$W/new.ids" | awk '$1 >= 300' | sort | uniq -c | sort -rn | awk 'NR==1{print $2}')
echo "a new id in the data: $row"
check test -n "$row"
check "$N" train --cluster "$C" --data "$W/new.txt" --steps 8 "${RUN[@]}" --checkpoint-dir "$W/ck" \
  2> "$W/train2.err"
check grep -q "resuming at step 4" "$W/train2.err"
check test -f "$W/ck/step-000008/manifest.json"
check $PY "$W/st.py" moved "$M2" "$W/ck/step-000008/manifest.json" "${row:-300}"

# ---- --learn-vocab: the job grows the model from its own data first ----
check "$N" train --cluster "$C" --data "$W/more.txt" --steps 10 "${RUN[@]}" --checkpoint-dir "$W/ck" \
  --learn-vocab 40 --log "$W/grow.jsonl" 2> "$W/train3.err"
cat "$W/train3.err"
check grep -q "the model grew (vocab) at step 8: vocab_size 359 -> 399" "$W/train3.err"
check grep -q '"event":"grow"' "$W/grow.jsonl"
check grep -q '"grow_step":8' "$W/grow.jsonl"
check test -f "$W/ck/step-000010/manifest.json"
check grep -q '"vocab_size": *399' "$W/ck/step-000010/manifest.json"

echo "test_cluster_grow: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
