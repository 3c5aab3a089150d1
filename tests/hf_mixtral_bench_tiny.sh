#!/usr/bin/env bash
# bench/hf_mixtral_bench.py's tiny case (it runs, its JSON is sane) with the
# transformers of the venv scripts/install-deps.sh makes (.venv-hf, or
# $NL_HF_VENV); made here when missing, as test_hf_transformers does; only
# where pip cannot install it (no package index) does it skip (exit 77).
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
exec "$VENV/bin/python" "$SRC/bench/hf_mixtral_bench.py" --tiny --device cpu --modes eager \
    --warmup 0 --iters 1 --spec "$SRC/configs/tiny.yaml:16"
