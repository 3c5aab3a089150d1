#!/usr/bin/env bash
# Issue 6 benchmark: a 3-node local cluster against one process, on the same
# checkpoint, in one run:
#   decode   greedy generation at batch 1: tokens/s over NEW_TOKENS, as
#            NEW / (time for NEW + 1 tokens - time for 1), so start-up, loading
#            and the prefill cancel out; REPS runs of each, local and cluster
#            interleaved, medians compared
#   hop      what each hop adds per token: (cluster ms per token - the stages'
#            compute per decode step, from the nodes' "session closed" lines)
#            / 3 hops (stage 0 -> 1 -> 2 -> 0: the last stage feeds its token
#            to the first itself)
#   prefill  forward of one 512-token sequence, tokens/s, 3 runs each
# Cores: the single process has 2 threads. Each node gets THREADS threads
# (default 2: the whole machine) and `cluster up`'s short OpenMP spin
# (--spin), so an idle stage sleeps and the working one has the cores: a
# decode step runs one stage at a time.
#   bench/bench_cluster.sh [BUILD_DIR] [NEW_TOKENS]
#   env: CONFIG (default configs/bench-small.yaml), THREADS (per node, 2),
#        SPIN (cluster up --spin, default its own), REPS (5)
set -euo pipefail
B=${1:-build}
NEW=${2:-128}
CONFIG=${CONFIG:-configs/bench-small.yaml}
THREADS=${THREADS:-2}
REPS=${REPS:-5}
N=$B/cli/neuroctl
W=$(mktemp -d)
C=$W/cluster
trap '"$N" cluster down --dir "$C" >/dev/null 2>&1 || true; rm -rf "$W"' EXIT
"$N" init --config "$CONFIG" --out "$W/m.safetensors" --seed 1 >/dev/null
/usr/bin/python3 - "$W" <<'PY'
import json, struct, sys
w = sys.argv[1]
toks = [(i * 7919 + 13) % 256 for i in range(512)]
h = json.dumps({"tokens": {"dtype": "I32", "shape": [1, 512], "data_offsets": [0, 4 * 512]}}).encode()
h += b" " * (-len(h) % 8)
open(w + "/prefill.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + struct.pack("<512i", *toks))
PY
now() { date +%s.%N; }
prompt=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16
gen_local() { "$N" generate --model "$W/m.safetensors" --prompt-tokens $prompt --max-new "$1" --temperature 0 --threads 2 >/dev/null; }
gen_cluster() { "$N" generate --cluster "$C" --prompt-tokens $prompt --max-new "$1" --temperature 0 >/dev/null; }
# seconds per NEW tokens of decode with generator $1
decode() { local a b c; a=$(now); "$1" 1; b=$(now); "$1" $((NEW + 1)); c=$(now); awk -v a="$a" -v b="$b" -v c="$c" 'BEGIN { printf "%.6f", (c - b) - (b - a) }'; }
spin=()
[ -n "${SPIN:-}" ] && spin=(--spin "$SPIN")
"$N" cluster up --dir "$C" --nodes 3 --model "$W/m.safetensors" --memory 4G --threads "$THREADS" "${spin[@]}" >/dev/null
gen_cluster 4 >/dev/null # warm-up: connections
gen_local 4 >/dev/null
L=() R=()
for ((i = 0; i < REPS; i++)); do
    L+=("$(decode gen_local)")
    R+=("$(decode gen_cluster)")
done
t0=$(now); for i in 1 2 3; do "$N" forward --model "$W/m.safetensors" --tokens "$W/prefill.safetensors" --out "$W/l.safetensors" --threads 2 >/dev/null; done; t1=$(now)
t2=$(now); for i in 1 2 3; do "$N" forward --cluster "$C" --tokens "$W/prefill.safetensors" --out "$W/r.safetensors" >/dev/null; done; t3=$(now)
"$N" status --cluster "$C" >&2
cat "$C"/node-*.log >"$W/nodes.log"
/usr/bin/python3 - "$NEW" "$THREADS" "$CONFIG" "$W/nodes.log" "${L[*]}" "${R[*]}" "$t0" "$t1" "$t2" "$t3" <<'PY'
import json, re, statistics, sys
new, threads, config, log = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
loc = [float(x) for x in sys.argv[5].split()]
clu = [float(x) for x in sys.argv[6].split()]
t = [float(x) for x in sys.argv[7:11]]
# each node's compute per decode step over the timed (long) sessions
step = {}
for line in open(log):
    m = re.search(r"\[(node-\d+)\] session \d+ closed: .* (\d+) decode steps of ([0-9.]+) ms", line)
    if m and int(m.group(2)) >= new:
        step.setdefault(m.group(1), []).append(float(m.group(3)))
stage_ms = {k: round(statistics.median(v), 3) for k, v in sorted(step.items())}
ld, cd = statistics.median(loc), statistics.median(clu)
clus_ms = cd / new * 1e3
out = {"bench": "cluster", "config": config, "nodes": 3, "threads_per_node": threads, "new_tokens": new,
       "reps": len(loc),
       "local_decode_tok_s": round(new / ld, 1), "cluster_decode_tok_s": round(new / cd, 1),
       "decode_ratio": round(ld / cd, 3),
       "local_decode_tok_s_runs": [round(new / x, 1) for x in loc],
       "cluster_decode_tok_s_runs": [round(new / x, 1) for x in clu],
       "local_ms_per_token": round(ld / new * 1e3, 3), "cluster_ms_per_token": round(clus_ms, 3),
       "stage_compute_ms_per_step": stage_ms,
       "hop_ms": round((clus_ms - sum(stage_ms.values())) / 3, 3) if len(stage_ms) == 3 else None,
       "local_prefill_tok_s": round(3 * 512 / (t[1] - t[0]), 1),
       "cluster_prefill_tok_s": round(3 * 512 / (t[3] - t[2]), 1),
       "prefill_ratio": round((t[1] - t[0]) / (t[3] - t[2]), 3)}
print(json.dumps(out))
PY
