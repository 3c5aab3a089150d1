#!/usr/bin/env bash
# Integration test: neuroctl import --hf / export --format hf against
# transformers itself (tests/hf/check_hf.py), in the venv that
# scripts/install-deps.sh makes (.venv-hf, or $NL_HF_VENV). When the venv
# is missing it is made here; only where pip cannot install it (no package
# index) does the test skip (exit 77), saying so.
set -u
SRC="${NL_SOURCE_DIR:-.}"
NEUROCTL="${NL_BUILD_DIR:-build}/cli/neuroctl"
VENV="${NL_HF_VENV:-$SRC/.venv-hf}"
has_hf() { "$VENV/bin/python" -c "import transformers, safetensors, torch" 2>/dev/null; }
if ! has_hf; then
    echo "test_hf_transformers: no transformers venv at $VENV; making it (scripts/install-deps.sh --hf-venv)"
    NL_HF_VENV="$VENV" bash "$SRC/scripts/install-deps.sh" --hf-venv >&2 || true
fi
if ! has_hf; then
    echo "SKIP: transformers could not be installed into $VENV (pip failed: no package index?)"
    exit 77
fi
TMP=$(mktemp -d "${TMPDIR:-/tmp}/nl_hf.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error OMP_NUM_THREADS=2
"$VENV/bin/python" "$SRC/tests/hf/check_hf.py" "$NEUROCTL" "$TMP" 2>&1 | grep -v 'Loading checkpoint shards'
exit "${PIPESTATUS[0]}"
