#!/usr/bin/env bash
# Integration test: the real `neuroctl tokenizer` train / learn / encode /
# decode / info on small files, round trips compared byte for byte, and
# the exit codes and messages of bad input.
set -u
NEUROCTL="${NL_BUILD_DIR:-build}/cli/neuroctl"
SRC="${NL_SOURCE_DIR:-.}"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/nl_tokcli.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
pass=0
fail=0

check() { # check DESCRIPTION COMMAND...: the command must succeed
    local what=$1
    shift
    if "$@"; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1))
        echo "FAIL: $what" >&2
    fi
}

# expect_fail CODE PATTERN DESCRIPTION COMMAND...: exit code CODE, stderr
# matching PATTERN
expect_fail() {
    local code=$1 pat=$2 what=$3
    shift 3
    "$@" >"$TMP/out" 2>"$TMP/err"
    local rc=$?
    if [ "$rc" -eq "$code" ] && grep -q -- "$pat" "$TMP/err"; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1))
        echo "FAIL: $what: exit $rc (want $code), stderr: $(cat "$TMP/err")" >&2
    fi
}

[ -x "$NEUROCTL" ] || { echo "no neuroctl at $NEUROCTL" >&2; exit 1; }

# a corpus from the project's own sources, plus every byte value
cat "$SRC"/core/*/*.c "$SRC"/core/*/*.h >"$TMP/corpus.txt"
for i in $(seq 0 255); do printf "\\$(printf %03o "$i")"; done >"$TMP/bytes.bin"
printf 'caf\xc3\xa9 \xd0\xbc\xd0\xb8\xd1\x80 \xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\x98\x80 \xff\xfe\x00x\n' \
    >"$TMP/mixed.bin"

# train
check "train" "$NEUROCTL" tokenizer train --input "$TMP/corpus.txt" "$TMP/mixed.bin" \
    --vocab-size 800 --out "$TMP/tok.bpe" --quiet
check "file magic" grep -q '^neurollm-bpe 2$' "$TMP/tok.bpe"
check "unicode split" grep -qx 'split unicode' "$TMP/tok.bpe"
"$NEUROCTL" tokenizer info --tokenizer "$TMP/tok.bpe" >"$TMP/info"
check "info vocab" grep -q '^vocab_size 800$' "$TMP/info"
check "info split" grep -q '^split unicode$' "$TMP/info"
check "info ids" grep -q '^ids native$' "$TMP/info"

# encode / decode round trips, through files and through pipes
for f in corpus.txt bytes.bin mixed.bin; do
    check "encode $f" "$NEUROCTL" tokenizer encode --tokenizer "$TMP/tok.bpe" \
        --input "$TMP/$f" --output "$TMP/$f.ids"
    check "decode $f" "$NEUROCTL" tokenizer decode --tokenizer "$TMP/tok.bpe" \
        --input "$TMP/$f.ids" --output "$TMP/$f.back"
    check "round trip $f" cmp -s "$TMP/$f" "$TMP/$f.back"
done
"$NEUROCTL" tokenizer encode --tokenizer "$TMP/tok.bpe" <"$TMP/corpus.txt" |
    "$NEUROCTL" tokenizer decode --tokenizer "$TMP/tok.bpe" >"$TMP/piped"
check "round trip through pipes" cmp -s "$TMP/corpus.txt" "$TMP/piped"
ids=$(wc -w <"$TMP/corpus.txt.ids")
bytes=$(wc -c <"$TMP/corpus.txt")
check "merges shorten the text ($ids ids for $bytes bytes)" [ "$ids" -lt $((bytes / 2)) ]
check "only ids below 800" awk '{ for (i = 1; i <= NF; i++) if ($i !~ /^[0-9]+$/ || $i >= 800 || ($i >= 256 && $i <= 258)) exit 1 }' "$TMP/corpus.txt.ids"
: >"$TMP/empty"
check "encode empty" "$NEUROCTL" tokenizer encode --tokenizer "$TMP/tok.bpe" --input "$TMP/empty" --output "$TMP/empty.ids"
check "empty gives no ids" [ ! -s "$TMP/empty.ids" ]

# a version 1 file (byte classes: every byte >= 0x80 a letter) keeps them:
# learning on it writes version 1 again, and a curly quote stays inside a word
printf 'neurollm-bpe 1\nmerges 0\n' >"$TMP/v1.bpe"
printf 'don\xe2\x80\x99t don\xe2\x80\x99t won\xe2\x80\x99t\n' >"$TMP/quotes.txt"
check "learn on version 1" "$NEUROCTL" tokenizer learn --tokenizer "$TMP/v1.bpe" --input "$TMP/quotes.txt" \
    --add 20 --min-count 1 --quiet
check "version 1 stays version 1" grep -q '^neurollm-bpe 1$' "$TMP/v1.bpe"
check "info: version 1 splits by bytes" sh -c "'$NEUROCTL' tokenizer info --tokenizer '$TMP/v1.bpe' | grep -q '^split bytes\$'"
printf 'don\xe2\x80\x99t' | "$NEUROCTL" tokenizer encode --tokenizer "$TMP/v1.bpe" >"$TMP/v1.ids"
check "version 1: one word" [ "$(wc -w <"$TMP/v1.ids")" -eq 1 ]
"$NEUROCTL" tokenizer train --input "$TMP/quotes.txt" --vocab-size 290 --min-count 1 --out "$TMP/v2.bpe" --quiet
printf 'don\xe2\x80\x99t' | "$NEUROCTL" tokenizer encode --tokenizer "$TMP/v2.bpe" >"$TMP/v2.ids"
check "version 2: don, quote, t" [ "$(wc -w <"$TMP/v2.ids")" -eq 3 ]

# learn: old merges stay, new ones follow
check "learn" "$NEUROCTL" tokenizer learn --tokenizer "$TMP/tok.bpe" --input "$TMP/mixed.bin" \
    "$SRC/docs/tokenizer.md" --add 50 --out "$TMP/tok2.bpe" --quiet
tail -n +4 "$TMP/tok.bpe" >"$TMP/old.merges"
head -n "$(wc -l <"$TMP/old.merges")" <(tail -n +4 "$TMP/tok2.bpe") >"$TMP/new.prefix"
check "old merges unchanged" cmp -s "$TMP/old.merges" "$TMP/new.prefix"
"$NEUROCTL" tokenizer info --tokenizer "$TMP/tok2.bpe" >"$TMP/info2"
check "learn grows the vocabulary" grep -q '^vocab_size 850$' "$TMP/info2"
cp "$TMP/tok.bpe" "$TMP/tok3.bpe"
check "learn in place" "$NEUROCTL" tokenizer learn --tokenizer "$TMP/tok3.bpe" \
    --input "$SRC/docs/tokenizer.md" --add 10 --quiet
check "rewritten in place" grep -q '^merges 551$' "$TMP/tok3.bpe"
"$NEUROCTL" tokenizer decode --tokenizer "$TMP/tok2.bpe" --input "$TMP/corpus.txt.ids" \
    --output "$TMP/old_ids_new_tok"
check "old ids decode the same with the grown tokenizer" cmp -s "$TMP/corpus.txt" "$TMP/old_ids_new_tok"

# bad input
echo "1 2 800 3" >"$TMP/bad.ids"
expect_fail 1 "line 1, offset 4: id 800 is not in the vocabulary" "unknown id" \
    "$NEUROCTL" tokenizer decode --tokenizer "$TMP/tok.bpe" --input "$TMP/bad.ids"
printf '1 2\n-3\n' >"$TMP/neg.ids"
expect_fail 1 "line 2, offset 4: expected a token id, found '-'" "negative id" \
    "$NEUROCTL" tokenizer decode --tokenizer "$TMP/tok.bpe" --input "$TMP/neg.ids"
echo "99999999999999999999999" >"$TMP/huge.ids"
expect_fail 1 "is not in the vocabulary" "huge id" \
    "$NEUROCTL" tokenizer decode --tokenizer "$TMP/tok.bpe" --input "$TMP/huge.ids"
echo "65 256 66" >"$TMP/special.ids"
expect_fail 1 "special id 256 refused" "strict decode" \
    "$NEUROCTL" tokenizer decode --tokenizer "$TMP/tok.bpe" --input "$TMP/special.ids" --strict
check "special ids decode to names" [ "$("$NEUROCTL" tokenizer decode --tokenizer "$TMP/tok.bpe" \
    --input "$TMP/special.ids")" = "A<|begin|>B" ]
head -c $(($(wc -c <"$TMP/tok.bpe") / 2)) "$TMP/tok.bpe" >"$TMP/half.bpe"
expect_fail 1 "truncated" "truncated tokenizer" \
    "$NEUROCTL" tokenizer encode --tokenizer "$TMP/half.bpe" --input "$TMP/mixed.bin"
expect_fail 1 "bad magic" "not a tokenizer" \
    "$NEUROCTL" tokenizer encode --tokenizer "$TMP/corpus.txt" --input "$TMP/mixed.bin"
expect_fail 1 "cannot open" "missing input" \
    "$NEUROCTL" tokenizer encode --tokenizer "$TMP/tok.bpe" --input "$TMP/nonexistent"
expect_fail 2 "needs --input, --vocab-size and --out" "train without --out" \
    "$NEUROCTL" tokenizer train --input "$TMP/corpus.txt" --vocab-size 300
expect_fail 2 "is not a number in 259" "vocab too small" \
    "$NEUROCTL" tokenizer train --input "$TMP/corpus.txt" --vocab-size 100 --out "$TMP/x.bpe"
expect_fail 2 "unknown option '--bogus'" "unknown option" \
    "$NEUROCTL" tokenizer encode --tokenizer "$TMP/tok.bpe" --bogus
expect_fail 2 "unknown command 'frobnicate'" "unknown subcommand" \
    "$NEUROCTL" tokenizer frobnicate
"$NEUROCTL" tokenizer decode --tokenizer "$TMP/tok.bpe" --input "$TMP/bad.ids" \
    --output "$TMP/failed.out" 2>/dev/null
check "failed decode leaves no output file" [ ! -e "$TMP/failed.out" ]
check "no temporary files left" [ -z "$(find "$TMP" -name '*.tmp.*')" ]
for sub in train learn encode decode info; do
    check "$sub --help" "$NEUROCTL" tokenizer "$sub" --help >/dev/null
done

echo "test_tokenizer_cli: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
