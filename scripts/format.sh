#!/usr/bin/env bash
# The source format (.clang-format), checked or applied over every C, header
# and CUDA file git tracks.
#   scripts/format.sh          check: lists the files clang-format would change
#                              and exits 1 if there are any (the test command
#                              runs this)
#   scripts/format.sh --fix    rewrite those files in place
# The tree is formatted with clang-format 14 (Debian 12's); another major
# version formats some constructs differently, so the check refuses it with
# a message rather than report differences that are only the version's.
set -euo pipefail
cd "$(dirname "$0")/.."
FIX=0
case "${1:-}" in
"") ;;
--fix) FIX=1 ;;
*)
  echo "usage: scripts/format.sh [--fix]" >&2
  exit 2
  ;;
esac
CF=""
for c in clang-format-14 clang-format; do
  if command -v "$c" >/dev/null 2>&1; then
    CF=$c
    break
  fi
done
if [ -z "$CF" ]; then
  echo "format: clang-format not found (Debian: apt-get install clang-format)" >&2
  exit 2
fi
major=$("$CF" --version | sed -n 's/.*clang-format version \([0-9]*\).*/\1/p')
if [ "$major" != 14 ]; then
  echo "format: $CF is version ${major:-unknown}; the tree is formatted with clang-format 14" \
    "(Debian 12's clang-format package)" >&2
  exit 2
fi
mapfile -t files < <(git ls-files '*.c' '*.h' '*.cu' '*.cuh')
if [ "$FIX" = 1 ]; then
  "$CF" -i "${files[@]}"
  echo "format: ${#files[@]} files formatted"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$CF" --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "format: ${#bad[@]} of ${#files[@]} files differ from .clang-format" \
    "(scripts/format.sh --fix rewrites them):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "format: ${#files[@]} files as .clang-format says"
