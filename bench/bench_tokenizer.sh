#!/usr/bin/env bash
# Tokenizer benchmark: ~10 MB of English from Debian's fortunes, training
# an 8192-id vocabulary and encoding/decoding on one thread. Prints JSON.
#   bench/bench_tokenizer.sh [BUILD_DIR] [VOCAB_SIZE] [MEGABYTES]
# Needs the `fortunes` package and a built BUILD_DIR (default: build).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build}
VOCAB=${2:-8192}
MB=${3:-10}
FORTUNES=/usr/share/games/fortunes
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nl_benchtok.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# the text: every fortune file (not the .dat indexes or .u8 links),
# concatenated and repeated to the size asked for
files=()
for f in "$FORTUNES"/*; do
    case "$f" in *.dat | *.u8) continue ;; esac
    [ -f "$f" ] && [ ! -L "$f" ] && files+=("$f")
done
[ ${#files[@]} -gt 0 ] || { echo "no fortune files in $FORTUNES (apt-get install fortunes)" >&2; exit 1; }
cat "${files[@]}" >"$WORK/once.txt"
want=$((MB * 1000000))
: >"$WORK/text.txt"
while [ "$(stat -c %s "$WORK/text.txt")" -lt "$want" ]; do
    cat "$WORK/once.txt" >>"$WORK/text.txt"
done
head -c "$want" "$WORK/text.txt" >"$WORK/bench.txt"

# the program: from the build tree when bench/CMakeLists.txt builds it,
# otherwise compiled here against the build's static libraries
BIN="$BUILD/bench/bench_tokenizer"
if [ ! -x "$BIN" ]; then
    cmake --build "$BUILD" --target nl_core >/dev/null
    BIN="$WORK/bench_tokenizer"
    cc -std=c11 -O2 -D_POSIX_C_SOURCE=200809L -I"$ROOT" "$ROOT/bench/bench_tokenizer.c" \
        "$BUILD/core/libnl_core.a" "$BUILD/base/libnl_base.a" -o "$BIN"
fi
echo "bench_tokenizer: $(stat -c %s "$WORK/bench.txt") bytes from ${#files[@]} fortune files ($(stat -c %s "$WORK/once.txt") bytes once), vocab $VOCAB" >&2
OMP_NUM_THREADS=1 "$BIN" "$WORK/bench.txt" "$VOCAB" 3
