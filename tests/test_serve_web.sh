#!/usr/bin/env bash
# neuroctl serve seen by the tools people point at it:
#   metrics    Prometheus' own linter (promtool check metrics, Debian's
#              prometheus) accepts /metrics after real traffic
#   dashboard  headless Chromium (Debian's chromium) renders GET / from a
#              serving process: one row per node, the plan with the layers
#              as neuroctl status writes them, a tokens/s chart with points,
#              the event log as sentences with the server's times; the
#              screenshot is kept as
#              $NL_BUILD_DIR/tests/serve-dashboard.png
# Usage: test_serve_web.sh metrics|dashboard. Exit 77 (skipped) only when
# the tool is not installed (scripts/install-deps.sh installs both).
set -euo pipefail
what=${1:?metrics or dashboard}
B=${NL_BUILD_DIR:-build}; S=${NL_SOURCE_DIR:-.}
DEV=${NL_TEST_DEVICE:-cpu}
case $what in
  metrics) tool=promtool ;;
  dashboard) tool=chromium ;;
  *) echo "unknown check $what" >&2; exit 2 ;;
esac
if ! command -v $tool >/dev/null; then
  echo "SKIP: $tool is not installed (apt-get install $([ $tool = promtool ] && echo prometheus || echo chromium))"
  exit 77
fi
T=$(mktemp -d)
PID=
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null; rm -rf "$T"; }
trap cleanup EXIT
"$B/cli/neuroctl" init --config "$S/configs/tiny.yaml" --out "$T/m.safetensors" >/dev/null
"$B/cli/neuroctl" serve --model "$T/m.safetensors" --http 127.0.0.1:0 --threads 2 --device "$DEV" \
  >"$T/serve.out" 2>"$T/serve.err" &
PID=$!
for _ in $(seq 600); do grep -q http:// "$T/serve.out" && break; sleep 0.1; done
URL=$(grep -o 'http://[0-9.:]*/' "$T/serve.out") || { cat "$T/serve.err"; exit 1; }
post() { curl -sf -H 'Content-Type: application/json' -d "$2" "${URL}${1#/}"; }
for i in 1 2 3; do post /v1/completions "{\"prompt\":[1,2,$i],\"max_tokens\":24,\"seed\":$i}" >/dev/null; done
post /v1/embeddings '{"input":"hello"}' >/dev/null
curl -s -o /dev/null -H 'Content-Type: application/json' -d '{bad' "${URL}v1/completions"   # a 400 in the counts
fail=0
if [ "$what" = metrics ]; then
  curl -sf "${URL}metrics" >"$T/metrics"
  promtool check metrics <"$T/metrics" || { echo "FAIL: promtool rejects /metrics"; fail=1; }
  for m in neurollm_tokens_generated_total neurollm_queue_depth neurollm_kv_cache_bytes \
           'neurollm_http_requests_total{endpoint="/v1/completions",code="200"} 3' \
           'neurollm_http_requests_total{endpoint="/v1/completions",code="400"} 1'; do
    grep -qF "$m" "$T/metrics" || { echo "FAIL: /metrics lacks $m"; fail=1; }
  done
  # the linter is not a rubber stamp: a metric without HELP/TYPE fails it
  if printf 'neurollm_bad_total 1\n' | promtool check metrics >/dev/null 2>&1; then
    echo "FAIL: promtool accepted a metric without HELP"; fail=1
  fi
else
  sleep 2   # a couple of stats events for the tokens/s chart
  shot="$B/tests/serve-dashboard.png"
  rm -f "$shot"
  CH=(chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --user-data-dir="$T/chrome"
      --virtual-time-budget=4000 --window-size=1280,1000)
  timeout 120 "${CH[@]}" --dump-dom "$URL" >"$T/dom.html" 2>"$T/chrome.err" || true
  timeout 120 "${CH[@]}" --screenshot="$shot" "$URL" >/dev/null 2>>"$T/chrome.err" || true
  dom=$(cat "$T/dom.html")
  check() { if grep -qE "$1" <<<"$dom"; then :; else echo "FAIL: the page lacks $2"; fail=1; fi; }
  check 'data-ready="1"' "a rendered status (body data-ready)"
  rows=$(grep -o '<tr class="node">' <<<"$dom" | wc -l)
  [ "$rows" -eq 1 ] || { echo "FAIL: $rows node rows, expected 1"; fail=1; }
  check '<div data-stage="0"[^>]*style="width: 100%;[^"]*">stage 0 · local · \[0,4\)\+e\+h</div>' \
    "the plan bar: local holds layers 0..3, the embedding and the head, as neuroctl status writes it"
  check '<td>local</td><td>serving</td><td>[^<]+</td><td[^>]*>[^<]+</td><td>[0-9.]+ MiB</td><td>\[0,4\)\+e\+h</td>' \
    "the node row with its layers as neuroctl status writes them"
  check 'id="tps-chart" data-points="[1-9][0-9]*"' "a tokens/s chart with points"
  # events as sentences, each with the time the server published it
  T='data-time="20[0-9-]+T[0-9:.]+Z"><time datetime="20[0-9-]+T[0-9:.]+Z">[0-9:.]+</time>'
  check "<li class=\"event\" data-type=\"start\" $T"'Serving m.safetensors on ' "the start event in the log"
  check "<li class=\"event\" data-type=\"request\" $T"'Request cmpl-[0-9]+: 3 prompt tokens, 24 generated \(length\)' \
    "a request event in the log"
  check '90 tokens generated|[0-9]+ tokens generated' "the summary line"
  [ -s "$shot" ] || { echo "FAIL: no screenshot at $shot"; fail=1; }
  [ $fail -eq 0 ] || { echo "--- DOM:"; head -c 4000 "$T/dom.html"; echo; cat "$T/chrome.err" | tail -5; }
fi
[ $fail -eq 0 ] && echo "test_serve_web $what: ok"
exit $fail
