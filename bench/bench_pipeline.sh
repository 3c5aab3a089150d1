#!/usr/bin/env bash
# Issue 7 benchmark: pipeline efficiency of distributed training.
#   1. one process, 1 thread            (the anchor for 2 nodes)
#   2. 2 nodes on loopback, 1 thread each, M = 8 microbatches (1F1B)
#   3. one process, 2 threads            (the anchor for 3 nodes: all the cores)
#   4. 3 nodes, 1 thread each
# Same checkpoint, data, seed, batch and microbatches everywhere; the
# figure per run is the median of the per-step tokens/s in the JSONL log,
# steps 3 and later (the first steps warm caches up). Prints JSON.
#   speedup        2-node tokens/s / 1-process-1-thread tokens/s (ideal 2*8/9 = 1.78)
#   send_share     per node of the 2-node run, from its log at the job's end: the share
#                  of the job's wall time its thread spent handing hops to the transport
#                  (encoding, copying; CURVE and TCP run on libzmq's I/O thread)
#   wait_share     ... and spent waiting for a hop (the 1F1B bubble, hops in flight, the
#                  coordinator's STEP round trip); the rest is computing
#   ratio_3_nodes  3-node tokens/s / 1-process-2-thread tokens/s
# Model: d 256, 8 layers, 8 heads (2 kv), 8 experts of 512, byte vocabulary
# (256 rows, so the head does not unbalance the stages); batch 16 x 128.
#   bench/bench_pipeline.sh [BUILD_DIR] [STEPS]          defaults: build 12
set -euo pipefail
B=${1:-build}
STEPS=${2:-12}
N=$B/cli/neuroctl
W=$(mktemp -d)
trap 'for c in "$W"/c*; do "$N" cluster down --dir "$c" >/dev/null 2>&1 || true; done; rm -rf "$W"' EXIT
cat > "$W/cfg.yaml" <<'YAML'
hidden_dim: 256
num_layers: 8
num_heads: 8
num_kv_heads: 2
ffn_dim: 512
num_experts: 8
vocab_size: 256
vocab_chunk: 256
max_seq_len: 256
YAML
DATA=$W/data.txt
find /usr/share/games/fortunes -type f ! -name '*.dat' ! -name '*.u8' ! -name '*.pdat' \
  -exec cat {} + 2>/dev/null | tr -d '\r' > "$DATA" || true
[ -s "$DATA" ] || cp tests/data/corpus.txt "$DATA"
"$N" init --config "$W/cfg.yaml" --out "$W/m.safetensors" --seed 1 >/dev/null
RUN=(--data "$DATA" --steps "$STEPS" --batch 16 --seq 128 --microbatches 8 --lr 1e-3 --seed 1)

"$N" train --model "$W/m.safetensors" "${RUN[@]}" --threads 1 --log "$W/l1.jsonl" --checkpoint-dir "$W/ckl" 2>/dev/null
"$N" cluster up --dir "$W/c2" --nodes 2 --model "$W/m.safetensors" --memory 2G --threads 1 >/dev/null
"$N" train --cluster "$W/c2" "${RUN[@]}" --checkpoint-dir "$W/ck" --log "$W/p2.jsonl" 2>/dev/null
"$N" status --cluster "$W/c2" >&2
"$N" cluster down --dir "$W/c2" >/dev/null
cat "$W"/c2/node-*.log | grep "ended:" > "$W/summary.txt" || true
"$N" train --model "$W/m.safetensors" "${RUN[@]}" --threads 2 --log "$W/l2.jsonl" --checkpoint-dir "$W/ckl" 2>/dev/null
"$N" cluster up --dir "$W/c3" --nodes 3 --model "$W/m.safetensors" --memory 2G --threads 1 >/dev/null
"$N" train --cluster "$W/c3" "${RUN[@]}" --checkpoint-dir "$W/ck" --log "$W/p3.jsonl" 2>/dev/null
"$N" status --cluster "$W/c3" >&2
"$N" cluster down --dir "$W/c3" >/dev/null

/usr/bin/python3 - "$W" <<'PY'
import json, re, statistics, sys
w = sys.argv[1]
def rate(name):
    rows = [json.loads(l) for l in open(w + "/" + name)]
    return statistics.median(r["tokens_per_s"] for r in rows if r["step"] >= 3)
l1, p2, l2, p3 = rate("l1.jsonl"), rate("p2.jsonl"), rate("l2.jsonl"), rate("p3.jsonl")
M, S = 8, 2
pat = re.compile(r"ended: ([\d.]+) s, of which computing ([\d.]+) s .*?sending (\d+) messages "
                 r"\(([\d.]+) MiB[^)]*\) ([\d.]+) s .*?waiting ([\d.]+) s")
nodes = []
for line in open(w + "/summary.txt"):
    m = pat.search(line)
    if m:
        wall, comp, msgs, mib, send, wait = map(float, m.groups())
        nodes.append({"compute_share": round(comp / wall, 3), "send_share": round(send / wall, 4),
                      "wait_share": round(wait / wall, 3), "messages": int(msgs), "mib": mib})
print(json.dumps({"bench": "pipeline", "microbatches": M, "tokens_per_step": 16 * 128,
                  "local_1thread_tok_s": round(l1, 1), "nodes2_tok_s": round(p2, 1),
                  "speedup": round(p2 / l1, 3), "ideal_speedup": round(M * S / (M + S - 1), 3),
                  "nodes2": nodes,
                  "local_2thread_tok_s": round(l2, 1), "nodes3_tok_s": round(p3, 1),
                  "ratio_3_nodes": round(p3 / l2, 3)}))
PY
