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
#  - depth (neurocoord --grow auto): a 2-node cluster (2 layers) trains 20
#    steps; a third node joins; at rest, right after that checkpoint, the
#    coordinator grows the model to 3 layers and re-plans over the 3 nodes;
#    the logits are bit-identical before and after; a second job (with a
#    smaller microbatch, so more layers fit) grows it again, to 6, right
#    after its step-30 checkpoint and goes on: the exported models before
#    and after that growth give bit-identical logits, and the new layers'
#    weights move in the steps after each growth; the step-40 result then
#    resumes on a 2-node cluster (another plan) with the same logits.
#  - width: `neuroctl grow --cluster --hidden-dim 64` widens that cluster's
#    model (32 -> 64, whole heads); logits within 1e-5 (relative) of the
#    narrow model's, and training goes on without a loss spike: against the
#    narrow model trained on from the same checkpoint, the first loss is the
#    same and the next ten stay within the spread of the narrow ones.
. "$(dirname "$0")/cluster_lib.sh"
export NL_TEST_GFLOPS=20 # equal throughputs: plans do not hang on disturbed probes
extra=0
test_cleanup() { [ "$extra" -gt 0 ] && kill "$extra" 2>/dev/null && wait "$extra" 2>/dev/null; }

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
elif what == "same":          # same A B: logits bit-identical
    a, b = tensors(sys.argv[2])["logits"], tensors(sys.argv[3])["logits"]
    assert a == b, "logits differ"
    print("logits bit-identical (%s)" % (a[0],))
elif what == "layers_moved":  # layers_moved A_MANIFEST B_MANIFEST L0 L1: layers [L0, L1) train
    # every weight outside the experts moved (wo: the block is no longer the
    # identity), and some expert's w_down did (an expert no token was routed
    # to in these steps keeps its zero w_down)
    (_, a), (_, b) = shards(sys.argv[2]), shards(sys.argv[3])
    wa = {k: v for s in a for k, v in s.items() if not k.startswith("optim.")}
    wb = {k: v for s in b for k, v in s.items() if not k.startswith("optim.")}
    for l in range(int(sys.argv[4]), int(sys.argv[5])):
        downs = 0
        for k in (x for x in wb if x.startswith("layers.%d." % l)):
            assert k in wa, k
            moved = max(abs(x - y) for x, y in zip(wa[k][1], wb[k][1])) > 0
            if ".experts." in k:
                downs += moved and k.endswith("w_down.weight")
            elif not k.endswith("norm.weight"):
                assert moved, "%s did not move" % k
        assert downs > 0, "no w_down of layer %d moved" % l
    print("layers [%s, %s) moved" % (sys.argv[4], sys.argv[5]))
elif what == "close":         # close A B TOL: relative L2 distance of the logits at most TOL
    a, b = tensors(sys.argv[2])["logits"][1], tensors(sys.argv[3])["logits"][1]
    assert len(a) == len(b)
    num = sum((x - y) ** 2 for x, y in zip(a, b)); den = sum(x * x for x in a)
    rel = (num / den) ** 0.5
    assert rel <= float(sys.argv[4]), rel
    print("logits within %.2e (relative)" % rel)
elif what == "no_spike":      # no_spike NARROW.jsonl WIDE.jsonl: the same steps, narrow and widened
    def losses(p):
        return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if "step" in r and "loss" in r}
    a, b = losses(sys.argv[2]), losses(sys.argv[3])
    steps = sorted(b)
    assert steps and set(steps) <= set(a), (steps, sorted(a))
    first = steps[0]   # before its update the widened model computes what the narrow one does
    assert abs(a[first] - b[first]) <= 1e-4 * abs(a[first]), (first, a[first], b[first])
    na = [a[k] for k in steps]; nb = [b[k] for k in steps]
    mean_a, mean_b = sum(na) / len(na), sum(nb) / len(nb)
    sd = (sum((x - mean_a) ** 2 for x in na) / len(na)) ** 0.5
    assert mean_b <= mean_a + sd, (mean_a, mean_b, sd)
    print("step %d: loss %.6f narrow, %.6f widened; steps %d..%d: mean %.4f narrow, %.4f widened "
          "(per-step spread %.4f)" % (first, a[first], b[first], steps[0], steps[-1], mean_a, mean_b, sd))
elif what == "history":       # history MANIFEST KIND...: the manifest's growth history, oldest first
    m = json.load(open(sys.argv[2]))
    kinds = [g["kind"] for g in m.get("growth", [])]
    assert kinds == sys.argv[3:], kinds
    print("growth history:", kinds)
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
corpus_small > "$W/data.txt"
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

check $PY "$W/st.py" history "$W/ck/step-000010/manifest.json" vocab vocab
"$N" cluster down --dir "$C" > /dev/null 2>&1

# ---- a cluster that serves the seed grows its vocabulary by config ----
S="$W/cs"
check "$N" cluster up "${DEV[@]}" --dir "$S" --nodes 2 --config "$W/cfg.yaml" --seed 5 --memory 64M \
  --kv-budget 1M --threads 1 --node-timeout-ms 3000 --timeout 60
check "$N" forward --cluster "$S" --tokens "$W/ids.safetensors" --out "$W/s_before.safetensors"
check "$N" tokenizer learn --cluster "$S" --input "$W/new.txt" --add 100 2> "$W/s.err"
check grep -q "vocabulary 300 -> 359" "$W/s.err"
check "$N" forward --cluster "$S" --tokens "$W/ids.safetensors" --out "$W/s_after.safetensors"
check $PY "$W/st.py" same_old "$W/s_before.safetensors" "$W/s_after.safetensors" 300
# its first checkpoint keeps the growth in its history
check "$N" train --cluster "$S" --data "$W/new.txt" --steps 2 "${RUN[@]}" --checkpoint-dir "$W/sk" 2> /dev/null
check $PY "$W/st.py" history "$W/sk/step-000002/manifest.json" vocab
"$N" cluster down --dir "$S" > /dev/null 2>&1
# a cluster that serves a checkpoint file is told how to grow
check "$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 7
check "$N" cluster up "${DEV[@]}" --dir "$S" --nodes 1 --model "$W/m.safetensors" --memory 64M \
  --kv-budget 1M --threads 1 --node-timeout-ms 3000 --timeout 60
"$N" grow --cluster "$S" --layers 8 2> "$W/s2.err"
check test $? -eq 1
check grep -q "growth needs a training manifest" "$W/s2.err"
"$N" cluster down --dir "$S" > /dev/null 2>&1

# ---- depth: --grow auto as a third node joins ----
sed -e 's/^num_layers: 6/num_layers: 2/' -e 's/^vocab_size: 300/vocab_size: 256/' \
  -e 's/^vocab_chunk: 64/vocab_chunk: 256/' "$W/cfg.yaml" > "$W/cfg2.yaml"
# The nodes' memory is chosen by the memory model (core/model/memory.c) so that,
# for a job of 2 x 32 rows in 2 microbatches, two nodes hold 2 layers but
# not the 3 that the hysteresis (1.3x parameters) asks for, and three
# nodes do; with 1 x 32 rows three nodes hold 6 layers. (The plans get
# --memory less the --kv-budget of 1M: 37952K.)
MEM=38976K
D="$W/cd"
check "$N" cluster up "${DEV[@]}" --dir "$D" --nodes 2 --config "$W/cfg2.yaml" --seed 3 --memory $MEM \
  --kv-budget 1M --threads 1 --node-timeout-ms 3000 --timeout 60 --grow auto
check "$N" train --cluster "$D" --data "$W/data.txt" --steps 20 "${RUN[@]}" --checkpoint-dir "$W/dk" \
  2> "$W/d1.err"
check grep -q "on 2 pipeline stages" "$W/d1.err"
check "$N" forward --cluster "$D" --tokens "$W/ids.safetensors" --out "$W/d_before.safetensors"
NODE="$NL_BUILD_DIR/node/neuronode"
"$N" keygen --out "$W/extra" > /dev/null
echo "$(cat "$W/extra.pub") node  # extra" >> "$D/coord/authorized_keys"
check reload_keys "$D"
"$NODE" join "${DEV[@]}" "$(cat "$D/coord/endpoint")" --key "$W/extra.key" \
  --coordinator-key "$D/coord/coordinator.pub" --memory $MEM --kv-budget 1M --threads 1 \
  --checkpoint-root / --name extra > "$W/extra.log" 2>&1 &
extra=$!
grown=0
for i in $(seq 1 300); do
  if "$N" status --cluster "$D" 2> /dev/null > "$W/dstatus.txt" && grep -q "^cluster: ready" "$W/dstatus.txt" &&
     grep -q "L=3" "$W/dstatus.txt"; then grown=1; break; fi
  sleep 0.2
done
cat "$W/dstatus.txt"
check test "$grown" -eq 1
check grep -q "last growth: depth at step 20: L 2 -> 3" "$W/dstatus.txt"
check test "$(grep -c serving "$W/dstatus.txt")" -eq 3
check grep -q "the model grows from 2" "$D/coord.log"
G1="$W/dk/step-000020-depth-3/manifest.json"
check test -f "$G1"
check $PY "$W/st.py" history "$G1" depth
check "$N" forward --cluster "$D" --tokens "$W/ids.safetensors" --out "$W/d_after.safetensors"
check $PY "$W/st.py" same "$W/d_before.safetensors" "$W/d_after.safetensors"

# a job with smaller microbatches: the nodes hold more layers; it grows at
# its first checkpoint (step 30) and goes on to step 40
check "$N" train --cluster "$D" --data "$W/data.txt" --steps 40 --batch 2 --seq 32 --microbatches 2 \
  --lr 3e-3 --seed 1 --checkpoint-every 10 --checkpoint-dir "$W/dk" --log "$W/d2.jsonl" 2> "$W/d2.err"
cat "$W/d2.err"
check grep -q "resuming at step 20" "$W/d2.err"
check grep -q "the model grew (depth) at step 30: num_layers 3 -> 6" "$W/d2.err"
check grep -q '"event":"grow".*"grow_step":30' "$W/d2.jsonl"
check grep -q '"kind":"depth"' "$W/d2.jsonl"
G2="$W/dk/step-000030-depth-6/manifest.json"
check test -f "$G2"
check test -f "$W/dk/step-000040/manifest.json"
check $PY "$W/st.py" history "$W/dk/step-000040/manifest.json" depth depth
check $PY "$W/st.py" layers_moved "$G1" "$W/dk/step-000030/manifest.json" 2 3
check $PY "$W/st.py" layers_moved "$G2" "$W/dk/step-000040/manifest.json" 3 6
for m in step-000030 step-000030-depth-6; do
  check "$N" export --manifest "$W/dk/$m" --out "$W/$m.safetensors"
  check "$N" forward "${DEV[@]}" --model "$W/$m.safetensors" --tokens "$W/ids.safetensors" \
    --out "$W/$m.logits.safetensors" --threads 1
done
check $PY "$W/st.py" same "$W/step-000030.logits.safetensors" "$W/step-000030-depth-6.logits.safetensors"
# the grown model trains on the cluster as in one process: the new layers'
# AdamW bias correction counts from their birth (step 20) on both
check "$N" export --manifest "$W/dk/step-000020-depth-3" --out "$W/g1.safetensors"
check "$N" train "${DEV[@]}" --resume "$W/g1.safetensors" --data "$W/data.txt" --steps 40 --batch 2 \
  --seq 32 --microbatches 2 --lr 3e-3 --seed 1 --checkpoint-every 10 --checkpoint-dir "$W/lk" \
  --threads 1 --out "$W/l40.safetensors" 2> "$W/l.err"
check $PY "$W/st.py" weights "$W/step-000030.safetensors" "$W/lk/step-000030.safetensors"
check "$N" forward --cluster "$D" --tokens "$W/ids.safetensors" --out "$W/d40.safetensors"
kill "$extra" 2> /dev/null
wait "$extra" 2> /dev/null
"$N" cluster down --dir "$D" > /dev/null 2>&1

# the result resumes from its manifest on another plan (2 nodes)
R="$W/cr"
check "$N" cluster up "${DEV[@]}" --dir "$R" --nodes 2 --resume "$W/dk/step-000040" --memory 64M \
  --kv-budget 1M --threads 1 --node-timeout-ms 3000 --timeout 60
"$N" status --cluster "$R" > "$W/rstatus.txt"
check grep -q "L=6" "$W/rstatus.txt"
check "$N" forward --cluster "$R" --tokens "$W/ids.safetensors" --out "$W/r40.safetensors"
check $PY "$W/st.py" same "$W/d40.safetensors" "$W/r40.safetensors"
check "$N" train --cluster "$R" --data "$W/data.txt" --steps 50 --batch 2 --seq 32 --microbatches 2 \
  --lr 3e-3 --seed 1 --checkpoint-dir "$W/rk" --log "$W/r1.jsonl" 2> "$W/r.err"
check grep -q "resuming at step 40" "$W/r.err"

# ---- width on the cluster ----
check "$N" forward --cluster "$R" --tokens "$W/ids.safetensors" --out "$W/w_before.safetensors"
check "$N" grow --cluster "$R" --hidden-dim 64 2> "$W/w.err"
cat "$W/w.err"
check grep -q "grew the model at step 50: hidden_dim 32 -> 64" "$W/w.err"
"$N" status --cluster "$R" > "$W/wstatus.txt"
check grep -q "model: d=64 L=6 H=8 G=4" "$W/wstatus.txt"
check grep -q "last growth: width at step 50: d 32 -> 64" "$W/wstatus.txt"
check "$N" forward --cluster "$R" --tokens "$W/ids.safetensors" --out "$W/w_after.safetensors"
check $PY "$W/st.py" close "$W/w_before.safetensors" "$W/w_after.safetensors" 1e-5
check "$N" train --cluster "$R" --data "$W/data.txt" --steps 60 --batch 2 --seq 32 --microbatches 2 \
  --lr 3e-3 --seed 1 --checkpoint-dir "$W/rk" --log "$W/r2.jsonl" 2> "$W/r2.err"
check grep -q "resuming at step 50" "$W/r2.err"
# the narrow model trained on from the same checkpoint in one process: the
# widened one's first loss is the narrow one's, and no spike follows
check "$N" export --manifest "$W/rk/step-000050" --out "$W/n50.safetensors"
check "$N" train "${DEV[@]}" --resume "$W/n50.safetensors" --data "$W/data.txt" --steps 60 --batch 2 \
  --seq 32 --microbatches 2 --lr 3e-3 --seed 1 --threads 1 --checkpoint-dir "$W/nk" \
  --log "$W/n60.jsonl" 2> "$W/n60.err"
check $PY "$W/st.py" no_spike "$W/n60.jsonl" "$W/r2.jsonl"
check $PY "$W/st.py" history "$W/rk/step-000060/manifest.json" depth depth width
# by hand between jobs only; a depth the model has is refused by name
"$N" grow --cluster "$R" --layers 6 2> "$W/w2.err"
check test $? -eq 1
check grep -q "the model has 6 already" "$W/w2.err"

echo "test_cluster_grow: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
