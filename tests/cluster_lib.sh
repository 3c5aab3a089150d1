# Sourced by the shell tests that start local clusters: the tools, the
# device, a scratch directory that is cleaned up with every cluster in it,
# the pass/fail counters, the wait for a training log's step (wait_step),
# and the small model configs they train.
#   N (neuroctl), NODE (neuronode), COORD (neurocoord), PY, DEV (the
#   --device of the local tools and the nodes: scripts/test.sh runs the
#   suite once more with NL_TEST_DEVICE=cpu-devsim), W (scratch), check CMD...
# A test that starts processes of its own defines test_cleanup; it runs
# first at exit. Clusters go down with `cluster down` (every directory
# under W that has a coord.pid), then anything still naming W is killed.
set -uo pipefail
N="$NL_BUILD_DIR/cli/neuroctl"
NODE="$NL_BUILD_DIR/node/neuronode"
COORD="$NL_BUILD_DIR/coordinator/neurocoord"
PY=/usr/bin/python3
DEV=(--device "${NL_TEST_DEVICE:-cpu}")
W=$(mktemp -d)
# the training text: the project's README and docs of 2026-11-27, frozen,
# so that editing the docs changes no test's numbers; corpus_small: its
# first 32340 bytes (that README)
CORPUS="$NL_SOURCE_DIR/tests/data/corpus.txt"
corpus_small() { head -c 32340 "$CORPUS"; }
pass=0
fail=0
check() { if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $*" >&2; fi; }

# wait_step LOG STEP [TRIES [PAUSE]]: until the training log LOG has step
# STEP, looking TRIES times (1200) PAUSE seconds apart (0.05); 1 if it
# never came
wait_step() {
  local i
  for i in $(seq 1 "${3:-1200}"); do
    grep -q "\"step\":$2," "$1" 2>/dev/null && return 0
    sleep "${4:-0.05}"
  done
  return 1
}

cluster_lib_exit() {
  declare -F test_cleanup >/dev/null && test_cleanup
  local p
  for p in "$W"/*/coord.pid; do
    [ -e "$p" ] && "$N" cluster down --dir "$(dirname "$p")" >/dev/null 2>&1
  done
  pkill -f "$W" 2>/dev/null
  if [ -n "${NL_TEST_KEEP:-}" ]; then echo "kept $W (NL_TEST_KEEP)" >&2; else rm -rf "$W"; fi
}
trap cluster_lib_exit EXIT

# small_config FILE HIDDEN LAYERS FFN MAX_SEQ: 4 heads (2 kv), 4 experts,
# a byte vocabulary in one chunk
small_config() {
  cat > "$1" <<YAML
hidden_dim: $2
num_layers: $3
num_heads: 4
num_kv_heads: 2
ffn_dim: $4
num_experts: 4
vocab_size: 256
vocab_chunk: 256
max_seq_len: $5
YAML
}
