#!/usr/bin/env bash
# The test hooks exist in test builds only (issue 15, finding 11; issue
# 31): a build without -DNL_TEST_HOOKS=ON has no trace of them (the node's
# NL_TEST_INJECT_NAN_*, NL_TEST_GFLOPS, NL_TEST_SLOW_*, NL_TEST_LINK_BYTES_S,
# NL_TEST_LOCAL_BREAK_AFTER, NL_TEST_DEVICE_*
# and its lying stage, NL_TEST_LIE, node/stage_train_lie.c; neuroctl's
# NL_TEST_INJECT_NAN_STEP and NL_TEST_SELFTEST_*), and a test build says
# so in --help. $1: 1 when this build has them, 0 when not.
set -u
NODE="$NL_BUILD_DIR/node/neuronode"
fail=0
if [ "${1:-0}" = 1 ]; then
  "$NODE" --help | grep -q "test build: NL_TEST_INJECT_NAN_STEP" || { echo "FAIL: no hooks in --help"; fail=1; }
  "$NODE" --help | grep -q "NL_TEST_LIE=KIND" || { echo "FAIL: no NL_TEST_LIE in --help"; fail=1; }
  # a malformed lie is a usage error that names the variable
  out=$(NL_TEST_LIE=fib:0.5 "$NODE" join tcp://127.0.0.1:1 2>&1); rc=$?
  { [ $rc = 2 ] && echo "$out" | grep -q "NL_TEST_LIE=fib:0.5"; } || { echo "FAIL: NL_TEST_LIE=fib:0.5: rc $rc: $out"; fail=1; }
else
  # issue 31: none of the hooks, in the node or in neuroctl
  for hook in NL_TEST_INJECT_NAN NL_TEST_GFLOPS NL_TEST_SLOW_ NL_TEST_LINK_BYTES_S NL_TEST_LOCAL_BREAK NL_TEST_DEVICE_; do
    if grep -aq "$hook" "$NODE"; then echo "FAIL: a production neuronode reads $hook*"; fail=1; fi
  done
  for hook in NL_TEST_INJECT_NAN NL_TEST_SELFTEST_; do
    if grep -aq "$hook" "$NL_BUILD_DIR/cli/neuroctl"; then
      echo "FAIL: a production neuroctl reads $hook*"; fail=1
    fi
  done
  if grep -aq "NL_TEST_LIE\|this stage lies" "$NODE"; then echo "FAIL: a production neuronode can lie (NL_TEST_LIE)"; fail=1; fi
  if "$NODE" --help | grep -q NL_TEST_INJECT_NAN; then echo "FAIL: --help lists the hooks"; fail=1; fi
fi
[ $fail = 0 ] && echo "test_node_hooks: passed (hooks ${1:-0})"
exit $fail
