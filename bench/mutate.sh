#!/usr/bin/env bash
# Mutation run (issue 34 item 8): plant plausible one-line bugs, one at a
# time, and check that the tests catch each.
#
#   bench/mutate.sh [BUILD_DIR] [--only N,M,...] [--list]
#
# For each mutation below: check that its original text occurs exactly once
# in its file (else it is reported "broken": the list went stale), apply it,
# rebuild incrementally in BUILD_DIR (default build-mutate, configured like
# the test build but without -DNL_WERROR, so a mutation that only warns still
# builds), run its tests, restore the file. A mutation that does not compile
# is reported "not compiled", apart from the score. Score = caught / compiled;
# the script exits 1 under 95%, 2 on a setup error.
#
# The tests run per mutation are a FAST PROXY: each mutation names a small
# ctest -R regex of the tests that own the code it breaks, so one mutation
# costs a minute or two on a slow machine. The definition in issue 34 is the
# whole suite per mutation: MUTATE_FULL=1 runs `ctest -L 'unit|integration'`
# instead (slow: tens of minutes per mutation). A mutation missed by its
# proxy may still be caught by the whole suite; one caught by the proxy is
# caught by the suite.
#
# The tree is never left mutated: each file is restored from a copy taken
# before the change (also on Ctrl-C or an error, by a trap), and the run ends
# with a `git diff --quiet` check of every file it touched. A file with
# uncommitted changes is refused (its mutation is reported broken), so the
# restore can never lose work. Restoring gives the file a new mtime, so the
# next build recompiles it back to the original.
#
# Environment: MUTATE_FULL=1 (whole suite), MUTATE_TIMEOUT (per-test
# seconds, default 300), MUTATE_JOBS (build jobs, default 1).
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)

BUILD=build-mutate
ONLY=""
LIST=0
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY="${2:-}"; shift 2 || { echo "mutate: --only needs N,M,..." >&2; exit 2; } ;;
    --only=*) ONLY="${1#--only=}"; shift ;;
    --list) LIST=1; shift ;;
    -h|--help) sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "mutate: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) BUILD="$1"; shift ;;
  esac
done
case "$ONLY" in *[!0-9,]*) echo "mutate: --only takes numbers: $ONLY" >&2; exit 2 ;; esac

# ---------------------------------------------------------------- mutations
# m FILE ORIGINAL REPLACEMENT TEST_REGEX  (ORIGINAL: exact text, unique in FILE)
N=0
declare -a F O R T
m() { F[N]=$1; O[N]=$2; R[N]=$3; T[N]=$4; N=$((N + 1)); }

# kernels
m kernels/elem.h 'return v > bv || (v == bv && i < bi);' \
  'return v > bv || (v == bv && i > bi);' '^test_elem$|^test_ops_cpu$'               # greedy tie-break reversed
m kernels/elem.h 'if (!taken && (best < 0 || row[e] > row[best]))' \
  'if (!taken && (best < 0 || row[e] >= row[best]))' '^test_elem$|^test_ops_cpu$|^test_model$' # top-k tie-break reversed
m kernels/elem.h '*p -= lr * (mi / bc1 / (sqrtf(vi / bc2) + eps) + wd * *p);' \
  '*p -= lr * (mi / bc1 / (sqrtf(vi / bc2) + eps));' '^test_elem$|^test_ops_train_cpu$|^test_train$' # decay dropped
m kernels/elem.h 'const float vi = b2 * *v + (1.0f - b2) * gi * gi;' \
  'const float vi = b2 * *v + (1.0f - b2) * gi;' '^test_elem$|^test_ops_train_cpu$|^test_train$'  # v not squared
m kernels/elem.h 'if ((u & 0x7fffffffu) > 0x7f800000u)' \
  'if ((u & 0x7fffffffu) >= 0x7f800000u)' '^test_elem$|^test_bf16$'                   # inf taken for NaN
m kernels/elem.h 'w[i] = row[choice[i]] / sum;' \
  'w[i] = row[choice[i]];' '^test_elem$|^test_ops_cpu$|^test_model$'                   # gate weights not renormalised
# core
m core/train/train_adamw.c 'const float bc1 = (float)(1.0 - pow(o.beta1, (double)t->adam_t));' \
  'const float bc1 = (float)(1.0 - pow(o.beta1, (double)(t->adam_t + 1)));' '^test_train$'  # bias correction one step ahead
m core/train/train_adamw.c 'return lr * (double)(step + 1) / (double)warmup;' \
  'return lr * (double)step / (double)warmup;' '^test_train$'                          # warmup starts at lr 0
m core/train/train_adamw.c 'const float wd = p->kind == NL_PARAM_NORM ? 0.0f : o.weight_decay;' \
  'const float wd = o.weight_decay;' '^test_train$'                                   # norms decayed
m core/model/kvcache.c 'if (B < 1 || cap < 1 || cap > m->cfg.max_seq_len)' \
  'if (B < 1 || cap < 1 || cap > m->cfg.max_seq_len + 1)' '^test_model$'              # cache one past the context
m core/model/forward.c 'if (memcmp(&sg->key, &key, sizeof key) != 0)' \
  'if (sg->key.B != key.B)' '^test_graphs_devsim$'                                     # a recording keyed by batch size only
m core/model/layer.c 's.pos = pos_d;' 's.pos = NULL;' '^test_graphs_devsim$'                 # a recorded step's past frozen at 0
m core/model/sampler.c 'if (!(top_p > 0.0f && top_p <= 1.0f))' \
  'if (!(top_p >= 0.0f && top_p <= 1.0f))' '^test_model$|^test_serve_http$'            # top_p 0 accepted
m core/model/sampler.c 'while (n < V && keep < s->top_p * sum)' \
  'while (n < V && keep <= s->top_p * sum)' '^test_model$'                             # nucleus one token too wide
m core/formats/safetensors.c 'if (end > data_size)' 'if (end > data_size + 1)' '^test_safetensors$'  # tensor one byte past the data
m core/formats/safetensors.c 'if (json_array_size(v) > NL_MAX_DIMS)' \
  'if (json_array_size(v) > NL_MAX_DIMS + 1)' '^test_safetensors$'                    # rank bound off by one
m core/model/config.c 'if (c->top_k < 1 || c->top_k > c->num_experts)' \
  'if (c->top_k < 1)' '^test_config$'                                                  # top_k above the experts accepted
m core/model/config.c 'if (!(c->rope_base > 1.0) || !isfinite(c->rope_base))' \
  'if (!(c->rope_base > 1.0))' '^test_config$'                                         # dropped inf check
m core/formats/checkpoint.c 'if (errno || end == s || *end || v < 0)' \
  'if (errno || end == s || v < 0)' '^test_checkpoint$'                                # trailing junk in a step number
m core/tokenizer/tokenizer.c 'if (n < 1 || n > NL_TOKENIZER_MAX_TOKEN_BYTES)' \
  'if (n < 1 || n > NL_TOKENIZER_MAX_TOKEN_BYTES + 1)' '^test_tokenizer$'              # token length bound off by one
m core/plan/planner.c 'if (!(a->gflops > 0) || !isfinite(a->gflops))' \
  'if (!(a->gflops >= 0) || !isfinite(a->gflops))' '^test_planner$'                    # a 0 GFLOP/s node accepted
m core/data/data.c 'if ((int64_t)v >= vocab_size) {' 'if ((int64_t)v > vocab_size) {' \
  '^replay_data$'                                                                      # an id equal to the vocabulary taken
m core/data/data.c 'if (tok && len % 4 != 0) {' 'if (tok && len % 4 > 2) {' '^replay_data$'  # a .tok file's torn last id taken
# net
m net/hopdigest.c 'if (strlen(said) != NL_HOP_DIGEST_HEX || sodium_memcmp(hex, said, NL_HOP_DIGEST_HEX) != 0)' \
  'if (strlen(said) != NL_HOP_DIGEST_HEX)' '^test_stage_train$|^test_wire$'           # hop digest never compared
m net/mpread.c 'if (v > (uint64_t)(r->end - r->p))' \
  'if (v > (uint64_t)(r->end - r->p) + 1)' '^test_wire$|^test_wire_limits$'            # string read one past the buffer
m net/mpread.c 'if ((uint32_t)depth + 1 > maxd)' 'if ((uint32_t)depth > maxd)' \
  '^test_wire$|^test_wire_limits$'                                                     # nesting bound off by one
m net/wire_schema.c 'if (!isfinite(d) || d < f->flo || d > f->fhi)' \
  'if (d < f->flo || d > f->fhi)' '^test_wire$|^test_wire_limits$'                     # dropped NaN check
m net/wire_schema.c 'if (cp < min_cp[k] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))' \
  'if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))' '^test_wire$|^test_wire_limits$'                 # overlong UTF-8 accepted
m net/wire.c 'if (hlen > lim->max_header)' 'if (hlen > lim->max_header + 1)' \
  '^test_wire$|^test_wire_limits$'                                                     # header bound off by one
m net/wire.c 'if (parts[i].len > lim->max_frame_bytes)' 'if (parts[i].len >= lim->max_frame_bytes)' \
  '^test_wire$|^test_wire_limits$'                                                     # frame exactly at the limit refused
# coordinator
m coordinator/coord_members.c 'if (!c->o.plaintext && strcmp(j->pubkey, rx->peer) != 0) {' \
  'if (0 && strcmp(j->pubkey, rx->peer) != 0) {' '^test_coord$|^test_coord_peers$'     # JOIN key check skipped
m coordinator/coord_generate.c 'else if (B != 1 || T >= c->cfg.max_seq_len)' \
  'else if (B != 1 || T > c->cfg.max_seq_len)' '^test_coord$|^test_serve_cluster_api$'                          # prompt filling the context accepted
m coordinator/coord_generate.c 'gp->limit = gp->max_new < gp->capacity - T ? gp->max_new : gp->capacity - T;' \
  'gp->limit = gp->max_new < gp->capacity - T + 1 ? gp->max_new : gp->capacity - T + 1;' '^test_coord$|^test_serve_cluster_api$' # one past the context
m coordinator/coord_train_verify.c 'int ok = memcmp(d, v->got[0], NL_HOP_DIGEST_BYTES) == 0;' \
  'int ok = 1;' '^test_coord$|^test_cluster_verify$'                                      # verification always agrees
m coordinator/coord_members.c 'if ((unsigned char)mark[i] < 0x20 || mark[i] == 0x7f)' \
  'if (mark[i] == 0x7f)' '^test_coord_peers$'                                          # a ban's reason breaks its line
m coordinator/coord_members.c 'for (const char *p = line + tl; !key && p + 2 + NL_KEY_Z85_LEN <= end; p++) {' \
  'for (const char *p = line + tl; p + 2 + NL_KEY_Z85_LEN <= end; p++) {' '^test_coord_peers$' # a banned line's last key taken
m coordinator/coord_journal.c 'json_integer_value(nj) < JOURNAL_MAX_ID)' 'json_integer_value(nj) > 0)' \
  '^test_coord_train$|^replay_journal$'                                                # journal ids past 2^53 taken
# node
m node/stage_session.c 'if (p->limit < 0 || p->limit > p->capacity)' \
  'if (p->limit < 0 || p->limit > p->capacity + 1)' '^test_node_stage$'                # session limit past its cache
m node/stage.c 'if (*T > kv->cap - at)' 'if (*T > kv->cap - at + 1)' '^test_node_stage$'  # cache overflow by one
m node/stage.c 'if (a->layer1 > (uint32_t)cfg.num_layers)' \
  'if (a->layer1 > (uint32_t)cfg.num_layers + 1)' '^test_node_stage$|^test_node$'                  # layer range past the model
m node/stage_train_make.c 'if (p->seq > s->model->cfg.max_seq_len)' \
  'if (p->seq > s->model->cfg.max_seq_len + 1)' '^test_stage_train$'                   # train seq past max_seq_len
m node/stage_train.c 'if (hop->microbatch >= limit)' 'if (hop->microbatch > limit)' \
  '^test_stage_train$'                                                                 # microbatch index off by one
# net: a stage's replicas
m net/allreduce.c 'x[i] = p[i] + x[i];' 'x[i] = p[i];' '^test_allreduce$'  # a replica's own gradients left out of the ring's sum
m net/allreduce.c 'if (a->r == a->R - 1 || a->r + 1 < a->R - 1)' \
  'if (a->r == a->R - 1 || a->r + 1 <= a->R - 1)' '^test_allreduce$'  # the result sent round once too far
# serve
m serve/http_api.c 'if (x < lo || x > hi)' 'if (x < lo || x >= hi)' '^test_serve_http$'  # integer bound off by one
m serve/http_api.c 'get_int(o, "logprobs", 0, NL_HTTP_MAX_LOGPROBS, &logprobs, fe)' \
  'get_int(o, "logprobs", 0, NL_HTTP_MAX_LOGPROBS + 1, &logprobs, fe)' '^test_serve_http$'  # logprobs bound

if [ "$LIST" = 1 ]; then
  for ((i = 0; i < N; i++)); do printf '%2d  %-32s %s\n' "$((i + 1))" "${F[i]}" "${R[i]}"; done
  exit 0
fi

# ---------------------------------------------------------------- setup
LOG="$BUILD/mutate-logs"
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  echo "mutate: configuring $BUILD" >&2
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DNL_TEST_HOOKS=ON -DNL_CUDA=OFF \
    >/dev/null || { echo "mutate: cmake failed" >&2; exit 2; }
fi
mkdir -p "$LOG"
JOBS=${MUTATE_JOBS:-1}
TMO=${MUTATE_TIMEOUT:-300}
echo "mutate: building $BUILD (unmutated)" >&2
nice -n 19 cmake --build "$BUILD" -j"$JOBS" >"$LOG/base-build.log" 2>&1 ||
  { echo "mutate: the unmutated tree does not build (see $LOG/base-build.log)" >&2; exit 2; }

BACKUP=$(mktemp -d)
CUR=""
restore() {
  if [ -n "$CUR" ]; then
    cat "$BACKUP/orig" >"$CUR" # new mtime: the next build recompiles it
    CUR=""
  fi
}
cleanup() { restore; rm -rf "$BACKUP"; }
trap cleanup EXIT
trap 'restore; echo; echo "mutate: interrupted, tree restored" >&2; exit 130' INT TERM

# replace the single occurrence of $2 in file $1 by $3; prints the count found
apply() {
  python3 - "$1" "$2" "$3" <<'PY'
import sys
path, orig, repl = sys.argv[1:4]
text = open(path, encoding="utf-8").read()
n = text.count(orig)
print(n)
if n == 1:
    open(path, "w", encoding="utf-8").write(text.replace(orig, repl))
PY
}

# the build targets the tests matching regex $1 run (their test programs),
# or nothing (= build all) when one is a script or MUTATE_FULL is set
targets() {
  [ "${MUTATE_FULL:-0}" = 1 ] && return
  local cmds t out=""
  cmds=$(cd "$BUILD" && ctest -N -V -R "$1" | sed -n 's/.*Test command: \([^ ]*\).*/\1/p')
  for t in $cmds; do
    case "$t" in "$ROOT/$BUILD"/*|"$BUILD"/*) out="$out --target $(basename "$t")" ;; *) return ;; esac
  done
  echo "$out"
}

selected() {
  [ -z "$ONLY" ] && return 0
  case ",$ONLY," in *",$1,"*) return 0 ;; esac
  return 1
}

# ---------------------------------------------------------------- run
caught=0 missed=0 nocomp=0 broken=0
declare -a RES=() SURV=()
touched=""
for ((i = 0; i < N; i++)); do
  id=$((i + 1))
  selected "$id" || continue
  f=${F[i]}
  touched="$touched $f"
  start=$SECONDS
  if ! git diff --quiet -- "$f" 2>/dev/null; then
    RES[i]="broken (uncommitted changes in $f)"; broken=$((broken + 1))
  else
    read -r -a tg <<<"$(targets "${T[i]}")"
    cp "$f" "$BACKUP/orig"
    CUR=$f
    cnt=$(apply "$f" "${O[i]}" "${R[i]}")
    if [ "$cnt" != 1 ]; then
      restore
      RES[i]="broken (original found $cnt times)"; broken=$((broken + 1))
    elif ! nice -n 19 cmake --build "$BUILD" -j"$JOBS" ${tg[@]+"${tg[@]}"} >"$LOG/$id-build.log" 2>&1; then
      restore
      RES[i]="not compiled"; nocomp=$((nocomp + 1))
    else
      if [ "${MUTATE_FULL:-0}" = 1 ]; then
        (cd "$BUILD" && nice -n 19 ctest -L 'unit|integration' --timeout "$TMO") >"$LOG/$id-test.log" 2>&1
      else
        (cd "$BUILD" && nice -n 19 ctest -R "${T[i]}" --timeout "$TMO") >"$LOG/$id-test.log" 2>&1
      fi
      rc=$?
      ran=$(grep -c 'Test *#' "$LOG/$id-test.log")
      restore
      if [ "$ran" = 0 ]; then
        RES[i]="broken (no test matches ${T[i]})"; broken=$((broken + 1))
      elif [ "$rc" != 0 ]; then
        RES[i]="caught"; caught=$((caught + 1))
      else
        RES[i]="MISSED"; missed=$((missed + 1)); SURV+=("$id")
      fi
    fi
  fi
  printf '%2d  %-12s %4ss  %s\n' "$id" "${RES[i]%% *}" "$((SECONDS - start))" "${F[i]}" >&2
done
trap - EXIT INT TERM
cleanup
# rebuild the restored tree so the build dir matches the sources again
nice -n 19 cmake --build "$BUILD" -j"$JOBS" >"$LOG/final-build.log" 2>&1

echo
printf '%-3s %-28s %-45s %s\n' "#" "file" "mutation" "result"
for ((i = 0; i < N; i++)); do
  [ -n "${RES[i]:-}" ] || continue
  printf '%-3s %-28s %-45.45s %s\n' "$((i + 1))" "${F[i]}" "${R[i]}" "${RES[i]}"
done
compiled=$((caught + missed))
echo
how="the listed tests (fast proxy)"
[ "${MUTATE_FULL:-0}" = 1 ] && how="the whole unit+integration suite"
echo "caught $caught of $compiled compiled mutations; not compiled $nocomp; broken $broken; tests: $how"
[ ${#SURV[@]} -gt 0 ] && echo "survivors: ${SURV[*]} (logs in $LOG)"
# shellcheck disable=SC2086
if [ -n "$touched" ] && ! git diff --quiet -- $touched; then
  echo "mutate: the tree is left modified:" >&2
  git diff --stat -- $touched >&2
  exit 2
fi
[ "$compiled" -gt 0 ] || { echo "mutate: nothing compiled" >&2; exit 2; }
if [ $((caught * 100)) -lt $((compiled * 95)) ]; then
  echo "score $((caught * 100 / compiled))% is under 95%"
  exit 1
fi
echo "score $((caught * 100 / compiled))%"
