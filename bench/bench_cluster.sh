#!/usr/bin/env bash
# Issue 6 benchmark: a 3-node local cluster against one process, on the same
# checkpoint, in one run:
#   decode   greedy generation at batch 1 of NEW_TOKENS: tokens/s after the
#            first token, as each tool reports it ("generate: ... then N in X
#            ms"), so start-up, loading and the prefill stay out; REPS runs of
#            each, local and cluster interleaved, medians compared
#   hop      what each hop adds per token: (cluster ms per token - the stages'
#            compute per decode step, from the nodes' "session closed" lines)
#            / 3 hops (stage 0 -> 1 -> 2 -> 0: the last stage feeds its token
#            to the first itself)
#   prefill  a 512-token prompt: 512 / the time to its first token, as
#            generate reports it (the cluster's includes opening the session
#            on every stage and the hops); REPS runs of each, interleaved
# Both sides are warm: the local runs use generate --warmup (the prompt run
# once before the clock starts), the cluster serves a decode and a prefill
# before the timed runs.
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
prompt=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16
long=$(seq -s, 1 512)
# generate's report on stderr: "first after X ms, then N in Y ms (R tokens/s)"
decode() { "$N" generate "$@" --prompt-tokens $prompt --max-new "$NEW" --temperature 0 2>&1 >/dev/null |
    sed -n 's/.*then .* (\([0-9.]*\) tokens\/s).*/\1/p'; }
prefill() { "$N" generate "$@" --prompt-tokens "$long" --max-new 1 --temperature 0 2>&1 >/dev/null |
    sed -n 's/.*first after \([0-9.]*\) ms.*/\1/p'; }
spin=()
[ -n "${SPIN:-}" ] && spin=(--spin "$SPIN")
"$N" cluster up --dir "$C" --nodes 3 --model "$W/m.safetensors" --memory 4G --threads "$THREADS" "${spin[@]}" >/dev/null
L=() R=() PL=() PR=()
decode --cluster "$C" >/dev/null # warm-up: connections, kernels, buffers
prefill --cluster "$C" >/dev/null
for ((i = 0; i < REPS; i++)); do
    L+=("$(decode --model "$W/m.safetensors" --threads 2 --warmup)")
    R+=("$(decode --cluster "$C")")
    PL+=("$(prefill --model "$W/m.safetensors" --threads 2 --warmup)")
    PR+=("$(prefill --cluster "$C")")
done
"$N" status --cluster "$C" >&2
cat "$C"/node-*.log >"$W/nodes.log"
/usr/bin/python3 - "$NEW" "$THREADS" "$CONFIG" "$W/nodes.log" "${L[*]}" "${R[*]}" "${PL[*]}" "${PR[*]}" <<'PY'
import json, re, statistics, sys
new, threads, config, log = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
loc = [float(x) for x in sys.argv[5].split()]  # tokens/s
clu = [float(x) for x in sys.argv[6].split()]
pl = [float(x) for x in sys.argv[7].split()]  # ms to the first token of 512
pr = [float(x) for x in sys.argv[8].split()]
# each node's compute per decode step in each timed session (the first
# session of NEW tokens was the warm-up), in order
step = {}
for line in open(log):
    m = re.search(r"\[(node-\d+)\] session \d+ closed: .* (\d+) decode steps of ([0-9.]+) ms", line)
    if m and int(m.group(2)) == new - 1:
        step.setdefault(m.group(1), []).append(float(m.group(3)))
runs = [sum(v[1 + i] for v in step.values()) for i in range(len(clu))] \
    if len(step) == 3 and all(len(v) == len(clu) + 1 for v in step.values()) else None
stage_ms = {k: round(statistics.median(v[1:]), 3) for k, v in sorted(step.items())}
ld, cd = statistics.median(loc), statistics.median(clu)
clus_ms = 1e3 / cd
out = {"bench": "cluster", "config": config, "nodes": 3, "threads_per_node": threads, "new_tokens": new,
       "reps": len(loc),
       "local_decode_tok_s": round(ld, 1), "cluster_decode_tok_s": round(cd, 1),
       "decode_ratio": round(cd / ld, 3),
       "local_decode_tok_s_runs": loc, "cluster_decode_tok_s_runs": clu,
       "local_ms_per_token": round(1e3 / ld, 3), "cluster_ms_per_token": round(clus_ms, 3),
       "stage_compute_ms_per_step": stage_ms,
       # per run: (its ms per token - its stages' compute per step) / 3 hops
       "hop_ms": round(statistics.median((1e3 / c - r) / 3 for c, r in zip(clu, runs)), 3) if runs else None,
       "local_prefill_tok_s": round(512e3 / statistics.median(pl), 1),
       "cluster_prefill_tok_s": round(512e3 / statistics.median(pr), 1),
       "prefill_ratio": round(statistics.median(pl) / statistics.median(pr), 3)}
print(json.dumps(out))
PY
