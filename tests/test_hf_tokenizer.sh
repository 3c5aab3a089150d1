#!/usr/bin/env bash
# Integration test: our tokenizer against Hugging Face's `tokenizers` library
# and transformers' AutoTokenizer, both ways (tests/hf/check_tokenizer.py):
# export --format hf of a tokenizer trained here, import --hf of one the
# library made (tokenizer.json, and vocab.json + merges.txt), a Unigram one
# named and left out; same ids and round trips on accents, curly quotes,
# dashes, CJK, emoji, digits and whitespace runs. The venv is the one
# scripts/install-deps.sh makes (.venv-hf, or $NL_HF_VENV); made here when
# missing, and only where pip cannot install it does the test skip (exit 77).
set -u
SRC="${NL_SOURCE_DIR:-.}"
NEUROCTL="${NL_BUILD_DIR:-build}/cli/neuroctl"
VENV="${NL_HF_VENV:-$SRC/.venv-hf}"
has_hf() { "$VENV/bin/python" -c "import transformers, tokenizers" 2>/dev/null; }
if ! has_hf; then
    echo "test_hf_tokenizer: no transformers venv at $VENV; making it (scripts/install-deps.sh --hf-venv)"
    NL_HF_VENV="$VENV" bash "$SRC/scripts/install-deps.sh" --hf-venv >&2 || true
fi
if ! has_hf; then
    echo "SKIP: tokenizers could not be installed into $VENV (pip failed: no package index?)"
    exit 77
fi
TMP=$(mktemp -d "${TMPDIR:-/tmp}/nl_hftok.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error OMP_NUM_THREADS=2
NL_SOURCE_DIR="$SRC" "$VENV/bin/python" "$SRC/tests/hf/check_tokenizer.py" "$NEUROCTL" "$TMP"
