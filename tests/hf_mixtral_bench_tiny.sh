#!/usr/bin/env bash
# bench/hf_mixtral_bench.py's tiny case with the transformers of the venv
# scripts/install-deps.sh makes (.venv-hf, or $NL_HF_VENV); made here when
# missing, as test_hf_transformers does; only where pip cannot install it (no
# package index) does it skip (exit 77). It runs forward, training and
# greedy decode (8 new tokens) on the CPU, eager, and checks the JSON lines:
# a tokens/s figure for forward and training of each model (--tiny's,
# builtin-tiny at T 32, and configs/tiny.yaml at T 16), and per model a
# decode line with tokens/s > 0 that generated exactly the 8 tokens asked
# for.
set -u
SRC="${NL_SOURCE_DIR:-.}"
VENV="${NL_HF_VENV:-$SRC/.venv-hf}"
has_tf() { "$VENV/bin/python" -c "import transformers, torch" 2>/dev/null; }
if ! has_tf; then
    echo "hf_mixtral_bench_tiny: no transformers in $VENV; making it (scripts/install-deps.sh --hf-venv)"
    NL_HF_VENV="$VENV" bash "$SRC/scripts/install-deps.sh" --hf-venv >&2 || true
fi
if ! has_tf; then
    echo "SKIP: transformers could not be installed into $VENV (pip failed: no package index?)"
    exit 77
fi
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
"$VENV/bin/python" "$SRC/bench/hf_mixtral_bench.py" --tiny --device cpu --modes eager \
    --warmup 0 --iters 1 --spec "$SRC/configs/tiny.yaml:16" --what forward,train,generate \
    --new-tokens 8 --prompt-tokens 16 >"$OUT"
rc=$?
cat "$OUT"
if [ "$rc" -ne 0 ]; then
    echo "FAIL: hf_mixtral_bench.py exited $rc"
    exit 1
fi
"$VENV/bin/python" - "$OUT" <<'PY'
import json, sys

lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ours = [j for j in lines if j.get("impl") == "transformers"]
bad = []
for cfg, seq in (("builtin-tiny", 32), ("tiny", 16)):  # --tiny's model and configs/tiny.yaml
    for what in ("forward", "train"):
        got = [j for j in ours if (j["config"], j["what"], j["seq"], j["mode"]) == (cfg, what, seq, "eager")]
        if len(got) != 1 or not got[0].get("tok_s", 0) > 0 or "error" in got[0]:
            bad.append("%s T%d: want one line with tok_s > 0, got %s" % (what, seq, got))
for cfg in ("builtin-tiny", "tiny"):  # one decode per config
    gen = [j for j in ours if j["what"] == "generate" and j["config"] == cfg]
    if len(gen) != 1:
        bad.append("generate %s: want one line, got %d" % (cfg, len(gen)))
        continue
    g = gen[0]
    want = {"mode": "eager", "batch": 1, "seq": 16, "new_tokens": 8, "generated": 8, "peak_frac": None}
    for k, v in want.items():
        if k not in g or g[k] != v:
            bad.append("generate %s: %s = %r, want %r" % (cfg, k, g.get(k, "(absent)"), v))
    if not g.get("tok_s", 0) > 0 or "error" in g:
        bad.append("generate %s: want tok_s > 0 and no error: %s" % (cfg, g))
    elif abs(g["ms_per_token"] - 1e3 / g["tok_s"]) > 0.01 * g["ms_per_token"]:
        bad.append("generate %s: ms_per_token %s is not 1000 / tok_s %s" % (cfg, g["ms_per_token"], g["tok_s"]))
summary = [j["summary"] for j in lines if "summary" in j]
if summary != [{"measurements": 6, "failed": 0, "skipped": 0, "ours": 0}]:
    bad.append("summary: %s" % summary)
for b in bad:
    print("FAIL:", b)
print("hf_mixtral_bench_tiny: %s" % ("FAIL" if bad else "forward, train and generate lines checked"))
sys.exit(1 if bad else 0)
PY
