#!/usr/bin/env bash
# Issue 6 benchmark: a 3-node local cluster against one process, on the same
# checkpoint (configs/bench-small.yaml), run one after the other:
#   decode   greedy generation at batch 1 (tokens/s over --max-new tokens)
#   prefill  forward of one 512-token sequence (tokens/s)
#   hop      (cluster seconds per token - local seconds per token) / hops
# Cores: the 3 nodes share the 2 cores; each gets cluster up's fair share,
# one thread (two OpenMP threads per node spin-wait and starve the stage
# that is working: 54 tok/s against 265). The single process has 2 threads.
#   bench/bench_cluster.sh [BUILD_DIR] [NEW_TOKENS]
set -euo pipefail
B=${1:-build}
NEW=${2:-128}
N=$B/cli/neuroctl
W=$(mktemp -d)
C=$W/cluster
trap '"$N" cluster down --dir "$C" >/dev/null 2>&1 || true; rm -rf "$W"' EXIT
"$N" init --config configs/bench-small.yaml --out "$W/m.safetensors" --seed 1 >/dev/null
/usr/bin/python3 - "$W" <<'PY'
import json, struct, sys
w = sys.argv[1]
toks = [(i * 7919 + 13) % 8192 for i in range(512)]
h = json.dumps({"tokens": {"dtype": "I32", "shape": [1, 512], "data_offsets": [0, 4 * 512]}}).encode()
h += b" " * (-len(h) % 8)
open(w + "/prefill.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + struct.pack("<512i", *toks))
PY
now() { date +%s.%N; }
prompt=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16
# decode rate = NEW / (time with NEW + 1 tokens - time with 1 token): start-up,
# loading and the prefill cancel out
gen_local() { "$N" generate --model "$W/m.safetensors" --prompt-tokens $prompt --max-new "$1" --temperature 0 --threads 2 >/dev/null; }
gen_cluster() { "$N" generate --cluster "$C" --prompt-tokens $prompt --max-new "$1" --temperature 0 >/dev/null; }
a=$(now); gen_local 1; b=$(now); gen_local $((NEW + 1)); c=$(now)
t0=$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.6f", 0 }'); t1=$(awk -v a="$a" -v b="$b" -v c="$c" 'BEGIN { printf "%.6f", (c - b) - (b - a) }')
"$N" forward --model "$W/m.safetensors" --tokens "$W/prefill.safetensors" --out "$W/l.safetensors" --threads 2 >/dev/null
t2=$(now); for i in 1 2 3; do "$N" forward --model "$W/m.safetensors" --tokens "$W/prefill.safetensors" --out "$W/l.safetensors" --threads 2 >/dev/null; done; t3=$(now)
# cluster
"$N" cluster up --dir "$C" --nodes 3 --model "$W/m.safetensors" --memory 1G >/dev/null
"$N" generate --cluster "$C" --prompt-tokens $prompt --max-new 4 --temperature 0 >/dev/null  # warm-up
a=$(now); gen_cluster 1; b=$(now); gen_cluster $((NEW + 1)); c=$(now)
t4=0; t5=$(awk -v a="$a" -v b="$b" -v c="$c" 'BEGIN { printf "%.6f", (c - b) - (b - a) }')
t6=$(now); for i in 1 2 3; do "$N" forward --cluster "$C" --tokens "$W/prefill.safetensors" --out "$W/r.safetensors" >/dev/null; done; t7=$(now)
"$N" status --cluster "$C" >&2
/usr/bin/python3 - "$NEW" "$t0" "$t1" "$t2" "$t3" "$t4" "$t5" "$t6" "$t7" <<'PY'
import json, sys
new = int(sys.argv[1]); t = [float(x) for x in sys.argv[2:]]
local_dec = new / (t[1] - t[0]); clus_dec = new / (t[5] - t[4])
local_pre = 3 * 512 / (t[3] - t[2]); clus_pre = 3 * 512 / (t[7] - t[6])
hop_ms = ((t[5] - t[4]) / new - (t[1] - t[0]) / new) / 4 * 1e3  # 4 hops: coord->s0->s1->s2->coord
print(json.dumps({"bench": "cluster", "nodes": 3, "threads_per_node": 1, "new_tokens": new,
                  "local_decode_tok_s": round(local_dec, 1), "cluster_decode_tok_s": round(clus_dec, 1),
                  "decode_ratio": round(clus_dec / local_dec, 3),
                  "local_prefill_tok_s": round(local_pre, 1), "cluster_prefill_tok_s": round(clus_pre, 1),
                  "prefill_ratio": round(clus_pre / local_pre, 3), "hop_ms_per_token": round(hop_ms, 3)}))
PY
