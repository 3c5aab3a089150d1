#!/usr/bin/env bash
# Issues 6 and 29: local clusters against one process, on the same
# checkpoint, in one run, for each model of CONFIGS:
#   decode   greedy generation at batch 1 of NEW_TOKENS: tokens/s after the
#            first token, as each tool reports it ("generate: ... then N in X
#            ms"), so start-up, loading and the prefill stay out; REPS runs of
#            each (one process, then each cluster of NODES), interleaved,
#            medians compared as ratios to the one process
#   ids      whether every cluster gave the one process's ids (each run)
#   hop      what each hop adds per token: (cluster ms per token - the stages'
#            compute per decode step, from the nodes' "session closed" lines)
#            / the hops of the ring (n nodes: n; one node feeds itself: 0,
#            so there it is the cost of the node's loop and the token's
#            report, reported as "loop_ms")
#   prefill  (PREFILL=1) a 512-token prompt: 512 / the time to its first
#            token, as generate reports it (the cluster's includes opening
#            the session on every stage and the hops); REPS runs, interleaved
# Both sides are warm: the local runs use generate --warmup (the prompt run
# once before the clock starts), each cluster serves a decode (and a
# prefill) before the timed runs. The one process runs THREADS threads, each
# node THREADS (default 1: a decode step runs one stage at a time, and one
# thread each is the comparison that counts the hops, not the cores).
#   bench/bench_cluster.sh [BUILD_DIR] [NEW_TOKENS]
#   env: CONFIGS (default "configs/bench-small.yaml configs/bench-large.yaml";
#        CONFIG, one file, is still read), NODES (cluster sizes, default
#        "1 3 3z": a size with a "z" runs its nodes with --no-local-link, so
#        its hops stay on ZeroMQ, side by side with the local links between
#        co-located stages), THREADS (1), SPIN (cluster up --spin, default
#        its own), REPS (5), PREFILL (0)
# Prints one JSON line per model and cluster size, and the load average
# (uptime) at the start and the end: compare the ratios of one run.
set -euo pipefail
B=${1:-build}
NEW=${2:-128}
CONFIGS=${CONFIGS:-${CONFIG:-configs/bench-small.yaml configs/bench-large.yaml}}
NODES=${NODES:-1 3 3z}
THREADS=${THREADS:-1}
REPS=${REPS:-5}
PREFILL=${PREFILL:-0}
N=$B/cli/neuroctl
W=$(mktemp -d)
down() {
    for d in "$W"/c*; do [ -d "$d" ] && "$N" cluster down --dir "$d" >/dev/null 2>&1; done
    return 0
}
trap 'down; rm -rf "$W"' EXIT
prompt=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16
long=$(seq -s, 1 512)
# generate's report on stderr: "first after X ms, then N in Y ms (R tokens/s)";
# the ids on stdout go to the file $1
decode() {
    local ids=$1
    shift
    "$N" generate "$@" --prompt-tokens $prompt --max-new "$NEW" --temperature 0 2>&1 >"$ids" |
        sed -n 's/.*then .* (\([0-9.]*\) tokens\/s).*/\1/p'
}
prefill() { "$N" generate "$@" --prompt-tokens "$long" --max-new 1 --temperature 0 2>&1 >/dev/null |
    sed -n 's/.*first after \([0-9.]*\) ms.*/\1/p'; }
spin=()
[ -n "${SPIN:-}" ] && spin=(--spin "$SPIN")
echo "bench_cluster: start, $(uptime)" >&2
for cfg in $CONFIGS; do
    down
    rm -rf "$W"/c* "$W"/*.ids "$W"/m.safetensors
    "$N" init --config "$cfg" --out "$W/m.safetensors" --seed 1 >/dev/null
    local_args=(--model "$W/m.safetensors" --threads "$THREADS" --warmup)
    for n in $NODES; do
        zmq=()
        [ "${n%z}" != "$n" ] && zmq=(--no-local-link)
        "$N" cluster up --dir "$W/c$n" --nodes "${n%z}" --model "$W/m.safetensors" --memory 4G \
            --threads "$THREADS" "${spin[@]}" "${zmq[@]}" >/dev/null
        decode "$W/warm.ids" --cluster "$W/c$n" >/dev/null # warm-up: connections, buffers
        [ "$PREFILL" = 1 ] && prefill --cluster "$W/c$n" >/dev/null
    done
    declare -A R=() PR=()
    L=() PL=() same=1
    for ((i = 0; i < REPS; i++)); do
        L+=("$(decode "$W/local.ids" "${local_args[@]}")")
        for n in $NODES; do
            R[$n]+="$(decode "$W/c$n.ids" --cluster "$W/c$n") "
            cmp -s "$W/local.ids" "$W/c$n.ids" || same=0
        done
        if [ "$PREFILL" = 1 ]; then
            PL+=("$(prefill "${local_args[@]}")")
            for n in $NODES; do PR[$n]+="$(prefill --cluster "$W/c$n") "; done
        fi
    done
    for n in $NODES; do
        cat "$W/c$n"/node-*.log >"$W/nodes.log"
        /usr/bin/python3 - "$NEW" "$THREADS" "$cfg" "$n" "$same" "$W/nodes.log" "${L[*]}" "${R[$n]}" \
            "${PL[*]:-}" "${PR[$n]:-}" <<'PY'
import json, re, statistics, sys
new, threads, config, same, log = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[5] == "1", sys.argv[6]
nodes, link = int(sys.argv[4].rstrip("z")), "zeromq" if sys.argv[4].endswith("z") else "local"
loc = [float(x) for x in sys.argv[7].split()]  # tokens/s
clu = [float(x) for x in sys.argv[8].split()]
pl = [float(x) for x in sys.argv[9].split()]  # ms to the first token of 512
pr = [float(x) for x in sys.argv[10].split()]
# each node's compute per decode step in each session of NEW tokens (the
# first was the warm-up), in order
step = {}
for line in open(log):
    m = re.search(r"\[(node-\d+)\] session \d+ closed: .* (\d+) decode steps of ([0-9.]+) ms", line)
    if m and int(m.group(2)) == new - 1:
        step.setdefault(m.group(1), []).append(float(m.group(3)))
runs = [sum(v[1 + i] for v in step.values()) for i in range(len(clu))] \
    if len(step) == nodes and all(len(v) == len(clu) + 1 for v in step.values()) else None
ld, cd = statistics.median(loc), statistics.median(clu)
out = {"bench": "cluster", "config": config, "nodes": nodes, "links": link, "threads_per_node": threads,
       "new_tokens": new, "reps": len(loc), "same_ids": same,
       "local_decode_tok_s": round(ld, 1), "cluster_decode_tok_s": round(cd, 1),
       "decode_ratio": round(cd / ld, 3),
       "local_decode_tok_s_runs": loc, "cluster_decode_tok_s_runs": clu,
       "local_ms_per_token": round(1e3 / ld, 3), "cluster_ms_per_token": round(1e3 / cd, 3),
       "stage_compute_ms_per_step": {k: round(statistics.median(v[1:]), 3) for k, v in sorted(step.items())}}
if runs:  # per run: its ms per token - its stages' compute per step
    rest = statistics.median(1e3 / c - r for c, r in zip(clu, runs))
    out["hop_ms" if nodes > 1 else "loop_ms"] = round(rest / nodes if nodes > 1 else rest, 3)
if pl and pr:
    out.update({"local_prefill_tok_s": round(512e3 / statistics.median(pl), 1),
                "cluster_prefill_tok_s": round(512e3 / statistics.median(pr), 1),
                "prefill_ratio": round(statistics.median(pl) / statistics.median(pr), 3)})
print(json.dumps(out), flush=True)
PY
    done
    unset R PR
done
echo "bench_cluster: end, $(uptime)" >&2
