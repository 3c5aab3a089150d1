#!/usr/bin/env bash
# The decode KV cache in bf16 against FP32 (--kv-cache, issue 29): `neuroctl
# generate` on a random model of CONFIG with a PROMPT-token prompt and NEW
# greedy tokens after it, --warmup (the prompt and one step run once before
# the clock starts), the two caches alternating ROUNDS times in one run (in
# ABBA order) so a shared machine's load falls on both alike. Prints each run's decode
# tokens/s (generate's own report: the tokens after the first over their
# time), the median of each, the ratio bf16 / fp32, and whether the greedy
# ids agree.
#   bench/bench_kv_cache.sh [BUILD_DIR]
#   env: CONFIG (configs/bench-large.yaml), PROMPT (512), NEW (256),
#        ROUNDS (4), THREADS (0: all cores), DEVICE (cpu)
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$SRC/build}
CONFIG=${CONFIG:-$SRC/configs/bench-large.yaml}
PROMPT=${PROMPT:-512}
NEW=${NEW:-256}
ROUNDS=${ROUNDS:-4}
THREADS=${THREADS:-0}
DEVICE=${DEVICE:-cpu}
NEUROCTL="$BUILD/cli/neuroctl"
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT

"$NEUROCTL" init --config "$CONFIG" --out "$W/m.safetensors" --seed 1 > /dev/null
V=$(sed -n 's/^vocab_size: *\([0-9]*\).*/\1/p' "$CONFIG")
prompt=$(python3 -c "print(','.join(str((i * 7919) % ($V - 1) + 1) for i in range($PROMPT)))")
run() { # kv-cache type -> tokens/s on stdout, ids in $W/ids.$1
    "$NEUROCTL" generate --model "$W/m.safetensors" --prompt-tokens "$prompt" --max-new "$NEW" \
        --temperature 0 --warmup --threads "$THREADS" --device "$DEVICE" --kv-cache "$1" \
        2> "$W/err" | head -1 > "$W/ids.$1"
    sed -n 's/.*(\([0-9.]*\) tokens\/s).*/\1/p' "$W/err"
}
f32=()
b16=()
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then # ABBA: neither cache always runs first
        f32+=("$(run fp32)")
        b16+=("$(run bf16)")
    else
        b16+=("$(run bf16)")
        f32+=("$(run fp32)")
    fi
    echo "round $r: fp32 ${f32[-1]} tok/s, bf16 ${b16[-1]} tok/s"
done
same=false
cmp -s "$W/ids.fp32" "$W/ids.bf16" && same=true
python3 - "${f32[*]}" "${b16[*]}" "$same" "$CONFIG" "$PROMPT" "$NEW" <<'PY'
import json, statistics, sys
f = [float(x) for x in sys.argv[1].split()]
b = [float(x) for x in sys.argv[2].split()]
mf, mb = statistics.median(f), statistics.median(b)
print(json.dumps({"config": sys.argv[4], "prompt": int(sys.argv[5]), "new": int(sys.argv[6]),
                  "fp32_tok_s": f, "bf16_tok_s": b, "fp32_median": mf, "bf16_median": mb,
                  "ratio_bf16_over_fp32": round(mb / mf, 3), "same_ids": sys.argv[3] == "true"}))
PY
