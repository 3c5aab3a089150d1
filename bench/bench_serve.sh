#!/usr/bin/env bash
# Issue 17 benchmark: `neuroctl serve` under 1, 4 and 16 concurrent
# streaming clients (Python's urllib, one thread each), NEW tokens each
# (greedy, ignoring nothing: every client runs to max_tokens):
#   agg_tok_s    all clients' tokens / the wall time from the first request
#                to the last [DONE]
#   ttft         time from sending a request to its first token chunk
#   itl          time between successive token chunks of one stream
#   rows_per_step, ms_per_step (serve only) the engine's batched steps in
#                the round (its /metrics counters): rows (decode tokens and
#                prefill positions) per step, and the round's wall time per step
# p50 and p99 over all clients of a round; an untimed warm-up round of
# the same size before each.
# Prints one JSON line per client count, then the ratio of the 16-client
# aggregate to the 1-client one (issue 17's targets: at least 6x on
# neuroctl serve, 4x on the cluster); on the cluster also each stage's
# figures from its heartbeats (hops, hops per batch, ms per batch, ms a
# hop spends on the stage).
#   bench/bench_serve.sh [BUILD_DIR] [NEW_TOKENS]
#   env: TARGET (serve: one process; cluster: a NODES-node local cluster,
#        neuroctl cluster up --http, THREADS each), CONFIG (default
#        configs/bench-small.yaml), THREADS (2), CLIENTS ("1 4 16"), PROMPT
#        (prompt tokens per client, 16), DEVICE (cpu), PRECISION (serve's
#        --precision, fp32), NODES (3), MAX_BATCH (16), PYTHON (the
#        clients' interpreter, /usr/bin/python3), CHUNK (--prefill-chunk,
#        64; serve only), ROUNDS (measured rounds per client count, 1: with
#        more, the best round's line, with every round's agg_tok_s in
#        agg_tok_s_all: on a machine others share, the least disturbed
#        round)
# A quick check at a tiny size:
#   CONFIG=configs/tiny.yaml CLIENTS="1 4" bench/bench_serve.sh build 16
#   TARGET=cluster THREADS=1 CONFIG=configs/tiny.yaml CLIENTS="1 4" bench/bench_serve.sh build 16
set -euo pipefail
B=${1:-build}
NEW=${2:-128}
CONFIG=${CONFIG:-configs/bench-small.yaml}
THREADS=${THREADS:-2}
CLIENTS=${CLIENTS:-1 4 16}
ROUNDS=${ROUNDS:-1}
PROMPT=${PROMPT:-16}
DEVICE=${DEVICE:-cpu}
PRECISION=${PRECISION:-fp32}
TARGET=${TARGET:-serve}
NODES=${NODES:-3}
N=$B/cli/neuroctl
W=$(mktemp -d)
PID=
cleanup() {
  [ -n "$PID" ] && kill "$PID" 2>/dev/null
  [ "$TARGET" = cluster ] && "$N" cluster down --dir "$W/c" >/dev/null 2>&1
  wait 2>/dev/null
  rm -rf "$W"
}
trap cleanup EXIT
"$N" init --config "$CONFIG" --out "$W/m.safetensors" --seed 1 >/dev/null
case $TARGET in
  serve)
    # every client from 127.0.0.1 at once: the per-address and request caps above the largest count
    MAXC=$(printf '%s\n' $CLIENTS | sort -n | tail -1)
    "$N" serve --model "$W/m.safetensors" --http 127.0.0.1:0 --threads "$THREADS" --device "$DEVICE" \
        --precision "$PRECISION" --max-batch "${MAX_BATCH:-16}" --prefill-chunk "${CHUNK:-64}" \
        --http-per-ip $((MAXC + 8)) --max-requests $((MAXC + 8)) >"$W/serve.out" 2>"$W/serve.err" &
    PID=$!
    for _ in $(seq 600); do grep -q http:// "$W/serve.out" && break; sleep 0.1; done
    ;;
  cluster)
    "$N" cluster up --dir "$W/c" --nodes "$NODES" --model "$W/m.safetensors" --threads "$THREADS" \
        --device "$DEVICE" --http 127.0.0.1:0 --timeout 300 >"$W/serve.out" 2>"$W/serve.err" ||
      { cat "$W/serve.err" >&2; exit 1; }
    ;;
  *) echo "TARGET: serve or cluster, not $TARGET" >&2; exit 2 ;;
esac
URL=$(grep -o 'http://[0-9.:]*/' "$W/serve.out") || { cat "$W/serve.err" >&2; exit 1; }
"${PYTHON:-/usr/bin/python3}" - "$URL" "$NEW" "$PROMPT" "$CONFIG" "$THREADS" "$DEVICE" "$TARGET" "$CLIENTS" "$ROUNDS" "$PRECISION" <<'PY'
import json, sys, threading, time, urllib.request
url, new, plen, config, threads, device, target = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7]
counts = [int(x) for x in sys.argv[8].split()]

def client(i, out):
    body = json.dumps({"prompt": [(i * 7 + t) % 200 + 1 for t in range(plen)], "max_tokens": new,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(url + "v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps = []
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                if json.loads(line[6:])["choices"][0]["token_ids"]:
                    stamps.append(time.perf_counter())
    out[i] = (t0, stamps)

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")

def metrics():  # neuroctl serve's engine counters (/metrics)
    d = {}
    for l in urllib.request.urlopen(url + "metrics", timeout=30).read().decode().splitlines():
        if l.startswith("neurollm_batch_"):
            k, v = l.split()
            d[k] = float(v)
    return d

def round_of(n):
    m0 = metrics() if target == "serve" else None
    out = [None] * n
    ts = [threading.Thread(target=client, args=(i, out)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    start = min(o[0] for o in out)
    end = max(o[1][-1] for o in out)
    toks = sum(len(o[1]) for o in out)
    ttft = [o[1][0] - o[0] for o in out]
    itl = [b - a for o in out for a, b in zip(o[1], o[1][1:])]
    r = {"target": target, "config": config, "device": device, "precision": sys.argv[10],
         "threads": int(threads), "clients": n,
         "new_tokens": new, "prompt_tokens": plen, "agg_tok_s": round(toks / (end - start), 1),
         "ttft_p50_ms": round(1e3 * pct(ttft, 50), 1), "ttft_p99_ms": round(1e3 * pct(ttft, 99), 1),
         "itl_p50_ms": round(1e3 * pct(itl, 50), 2), "itl_p99_ms": round(1e3 * pct(itl, 99), 2)}
    if m0 is not None:  # the engine's steps in this round: rows per step, wall ms per step
        m1 = metrics()
        steps = m1["neurollm_batch_steps_total"] - m0["neurollm_batch_steps_total"]
        rows = m1["neurollm_batch_rows_total"] - m0["neurollm_batch_rows_total"]
        if steps > 0:
            r["rows_per_step"] = round(rows / steps, 2)
            r["ms_per_step"] = round(1e3 * (end - start) / steps, 2)
    return r

res = {}
rounds = int(sys.argv[9])
for n in counts:
    round_of(n)  # warm-up: oneDNN compiles its kernels for each new GEMM shape
    runs = [round_of(n) for _ in range(rounds)]
    res[n] = max(runs, key=lambda r: r["agg_tok_s"])  # the best: the least disturbed by others
    if rounds > 1:
        res[n]["rounds"] = rounds
        res[n]["agg_tok_s_all"] = [r["agg_tok_s"] for r in runs]
    print(json.dumps(res[n]), flush=True)
if 1 in res and len(res) > 1:
    top = max(res)
    print(json.dumps({"speedup_%d_over_1" % top: round(res[top]["agg_tok_s"] / res[1]["agg_tok_s"], 2)}))
if target == "cluster":  # the stages' own figures (heartbeats), over the whole run
    time.sleep(2.5)
    st = json.loads(urllib.request.urlopen(url + "api/status", timeout=30).read())
    for n in st["nodes"]:
        if n.get("hops"):
            print(json.dumps({"node": n["name"], "layers": n.get("layers"), "hops": n["hops"],
                              "hops_per_batch": round(n["hops_per_batch"], 2),
                              "batch_ms": round(n["batch_ms"], 2), "hop_ms": round(n["hop_ms"], 2)}))
PY
