#!/usr/bin/env bash
# Integration test: the official openai Python client against neuroctl serve
# and neurocoord --http (tests/test_openai_client.py), in the venv that
# scripts/install-deps.sh makes (.venv-hf, or $NL_HF_VENV; the client is
# pinned in its HF_PINS). When the venv is missing or lacks the client it is
# made here; only where pip cannot install it (no package index) does the
# test skip (exit 77), saying so.
set -u
SRC="${NL_SOURCE_DIR:-.}"
VENV="${NL_HF_VENV:-$SRC/.venv-hf}"
has_openai() { "$VENV/bin/python" -c "import openai" 2>/dev/null; }
if ! has_openai; then
    echo "test_openai_client: no openai client in $VENV; making it (scripts/install-deps.sh --hf-venv)"
    NL_HF_VENV="$VENV" bash "$SRC/scripts/install-deps.sh" --hf-venv >&2 || true
fi
if ! has_openai; then
    echo "SKIP: the openai client could not be installed into $VENV (pip failed: no package index?)"
    exit 77
fi
exec "$VENV/bin/python" "$SRC/tests/test_openai_client.py"
