#!/usr/bin/env python3
"""neuroctl serve from a client no one here wrote (Python's urllib and raw
sockets): completions equal `neuroctl generate` with the same seed,
streaming gives the same ids chunk by chunk, 16 concurrent seeded
generations equal their solo runs, bad requests get 4xx with a message
and the server stays up, a dropped stream frees its session, the limits
(429, 401, slow clients) hold, embeddings are unit vectors, events flow;
serve --adapter (merged at load) completes as `neuroctl generate
--adapter` does, and /v1/models names the pair.
Optional argument: a file to write the server's /metrics text into."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

BUILD = os.environ.get("NL_BUILD_DIR", "build")
SRC = os.environ.get("NL_SOURCE_DIR", ".")
NEUROCTL = os.path.join(BUILD, "cli", "neuroctl")
DEVICE = os.environ.get("NL_TEST_DEVICE", "cpu")
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, file=sys.stderr)


class Server:
    def __init__(self, model, *extra):
        self.p = subprocess.Popen([NEUROCTL, "serve", "--model", model, "--http", "127.0.0.1:0",
                                   "--threads", "2", "--device", DEVICE, *extra],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        if not m:
            raise RuntimeError("serve did not start: %r %s" % (line, self.p.stderr.read()))
        self.port = int(m.group(1))
        self.base = "http://127.0.0.1:%d" % self.port

    def request(self, path, body=None, headers=None, method=None, raw=None):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers=dict({"Content-Type": "application/json"},
                                                  **(headers or {})))
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def json(self, path, body=None, **kw):
        code, text = self.request(path, body, **kw)
        try:
            return code, json.loads(text)
        except ValueError:
            return code, text

    def metrics(self):
        return {m.group(1): float(m.group(2)) for m in
                re.finditer(r"^(neurollm_[a-z_]+) ([0-9.e+-]+)$",
                            self.request("/metrics")[1].decode(), re.M)}

    def alive(self):
        return self.p.poll() is None and self.request("/v1/models")[0] == 200

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        return self.p.returncode


def generate_ids(model, prompt, n, temp, top_p, seed, *extra):
    out = subprocess.run([NEUROCTL, "generate", "--model", model, "--prompt-tokens",
                          ",".join(map(str, prompt)), "--max-new", str(n), "--temperature",
                          str(temp), "--top-p", str(top_p), "--seed", str(seed), "--threads",
                          "2", "--device", DEVICE, *extra], capture_output=True, check=True)
    return [int(x) for x in out.stdout.splitlines()[0].split()]


def completion(s, prompt, n, temp, top_p, seed, **more):
    body = dict(prompt=prompt, max_tokens=n, temperature=temp, top_p=top_p, seed=seed, **more)
    code, r = s.json("/v1/completions", body)
    check(code == 200, "completion answered 200 (%s: %s)" % (code, r))
    return r if code == 200 else None


def stream(s, body):
    """The stream's chunks as parsed JSON, and whether [DONE] closed it."""
    req = urllib.request.Request(s.base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks, done = [], False
    with urllib.request.urlopen(req, timeout=60) as r:
        check(r.headers.get("Content-Type") == "text/event-stream", "an event stream")
        for line in r:
            line = line.decode().rstrip("\n")
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    return chunks, done


def test_equal_generate(s, model):
    for prompt, temp, top_p, seed in [([1, 2, 3], 0.0, 1.0, 0), ([10, 20, 30, 40], 0.8, 0.95, 7),
                                      (list(range(5, 90)), 1.0, 0.9, 3)]:
        want = generate_ids(model, prompt, 20, temp, top_p, seed)
        r = completion(s, prompt, 20, temp, top_p, seed)
        if r:
            got = r["choices"][0]["token_ids"]
            check(got == want, "completion ids %s equal generate's %s" % (got, want))
            check(r["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 20,
                                 "total_tokens": len(prompt) + 20}, "usage %s" % r["usage"])
            check(r["choices"][0]["finish_reason"] == "length", "finish_reason length")
        chunks, done = stream(s, dict(prompt=prompt, max_tokens=20, temperature=temp,
                                      top_p=top_p, seed=seed, stream=True))
        check(done, "the stream ends with data: [DONE]")
        per = [c["choices"][0]["token_ids"] for c in chunks[:-1]]
        check(all(len(p) == 1 for p in per), "one id per chunk")
        check(sum(per, []) == want, "streamed ids %s equal generate's" % sum(per, []))
        check(chunks[-1]["choices"][0]["finish_reason"] == "length" and
              chunks[-1]["usage"]["completion_tokens"] == 20, "last chunk: finish and usage")
    # a text prompt through the model's tokenizer, and a stop string
    r = completion(s, "Hello", 12, 0.0, 1.0, 0)
    if r:
        text = r["choices"][0]["text"]
        check(isinstance(text, str) and r["usage"]["prompt_tokens"] == 5, "text prompt: 5 bytes")
        cut = completion(s, "Hello", 12, 0.0, 1.0, 0, stop=[text[2:4]]) if len(text) > 4 else None
        if cut:
            check(cut["choices"][0]["finish_reason"] == "stop" and
                  cut["choices"][0]["text"] == text[:text.find(text[2:4])],
                  "stop string cuts the text: %r" % cut["choices"][0])


def test_concurrent(s):
    prompts = [[(i * 37 + t * 11) % 256 for t in range(3 + i % 7)] for i in range(16)]
    solo = []
    for i in range(16):
        r = completion(s, prompts[i], 24, 0.9, 0.95, 100 + i)
        solo.append(r["choices"][0]["token_ids"] if r else None)
    before = s.metrics()
    together = [None] * 16

    def run(i):
        r = completion(s, prompts[i], 24, 0.9, 0.95, 100 + i, stream=False)
        together[i] = r["choices"][0]["token_ids"] if r else None

    ts = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    after = s.metrics()
    for i in range(16):
        check(solo[i] is not None and solo[i] == together[i],
              "generation %d: the same ids alone and among 15 others" % i)
    steps = after["neurollm_batch_steps_total"] - before["neurollm_batch_steps_total"]
    rows = after["neurollm_batch_rows_total"] - before["neurollm_batch_rows_total"]
    check(steps > 0 and rows / steps > 2, "decode steps were batched (%.1f rows a step)" %
          (rows / max(steps, 1)))


def test_bad_requests(s):
    cases = [
        (b'{"prompt": [1, 2', "malformed JSON", None),
        (b'[1, 2]', "JSON object", None),
        (b'{"prompt": [1], "max_tokens": "8"}', "max_tokens", "max_tokens"),
        (b'{"prompt": [1], "max_tokens": 0}', "max_tokens", "max_tokens"),
        (b'{"prompt": [1], "max_tokens": 100000000}', "max_tokens", "max_tokens"),
        (b'{"prompt": [1], "temperature": "hot"}', "temperature", "temperature"),
        (b'{"prompt": [1], "top_p": -0.01}', "top_p", "top_p"),
        (b'{"prompt": [1], "top_p": 1.5}', "top_p", "top_p"),
        (b'{"prompt": [1], "seed": 1.5}', "seed", "seed"),
        (b'{"prompt": [1], "response_format": {"type": "json_object"}}', "response_format",
         "response_format"),
        (b'{"prompt": [1], "stream": "yes"}', "stream", "stream"),
        (b'{"prompt": [1], "stop": 3}', "stop", "stop"),
        (b'{"prompt": 5}', "prompt", "prompt"),
        (b'{"prompt": [1, "a"]}', "prompt[1]", "prompt"),
        (b'{"prompt": ["a", "b"]}', "a batch", "prompt"),
        (b'{"prompt": [[1], [2]]}', "a batch", "prompt"),
        (b'{"prompt": [[100000]]}', "vocabulary", "prompt"),
        (b'{"prompt": [100000]}', "vocabulary", "prompt"),
        (b'{"prompt": ""}', "empty", "prompt"),
        (b'{"max_tokens": 3}', "prompt: required", "prompt"),
        (b'{"prompt": [1], "bogus": 1}', "bogus", "bogus"),
        (b'{"prompt": [1], "n": 17}', "n", "n"),
        (b'{"prompt": [1], "logprobs": 21}', "logprobs", "logprobs"),
        (b'{"prompt": [1], "prompt": [2]}', "duplicate", None),
    ]
    # the context's end: a prompt of 3 tokens leaves CTX - 3 to generate;
    # one more is refused before any work (not a 500 from the KV cache)
    ctx = int(re.search(r"^max_seq_len: *(\d+)", open(os.path.join(SRC, "configs", "tiny.yaml")).read(),
                        re.M).group(1))
    cases.append((json.dumps({"prompt": [1, 2, 3], "max_tokens": ctx - 2}).encode(),
                  "max_tokens: %d is more than the %d positions" % (ctx - 2, ctx - 3), "max_tokens"))
    code, r = s.json("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": ctx - 3})
    check(code == 200 and r["usage"]["completion_tokens"] <= ctx - 3,
          "max_tokens up to the context's end: %s %s" % (code, str(r)[:200]))
    for raw, words, param in cases:
        code, r = s.json("/v1/completions", raw=raw)
        ok = code == 400 and isinstance(r, dict) and words in r["error"]["message"]
        check(ok, "%s -> 400 naming %r (%s %s)" % (raw, words, code, r))
        if ok and param:
            check(r["error"]["param"] == param, "param %s for %s" % (param, raw))
    code, r = s.json("/v1/embeddings", raw=b'{"input": 7}')
    check(code == 400 and "input" in r["error"]["message"], "embeddings: bad input 400")
    code, r = s.json("/v1/completions", raw=b'{"prompt": "' + b"a" * (1100 * 1024) + b'"}')
    check(code == 413 and "limit" in r["error"]["message"], "an oversized body -> 413 (%s)" % code)
    code, r = s.json("/v1/completions", method="GET")
    check(code == 405, "GET /v1/completions -> 405 (%s)" % code)
    code, r = s.json("/nowhere")
    check(code == 404 and "no such endpoint" in r["error"]["message"], "unknown path -> 404")
    check(s.alive(), "the server is still up after the bad requests")


def test_dropped_client(s):
    start = s.metrics()["neurollm_tokens_generated_total"]
    sock = socket.create_connection(("127.0.0.1", s.port))
    body = json.dumps(dict(prompt=[1, 2, 3], max_tokens=200, stream=True, seed=1)).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while got.count(b"data: ") < 2:
        got += sock.recv(4096)
    m = s.metrics()
    check(m["neurollm_sessions_active"] == 1 and m["neurollm_kv_cache_bytes"] > 0,
          "a streaming session holds a KV cache")
    sock.close()
    deadline = time.time() + 20
    while time.time() < deadline:
        m = s.metrics()
        if m["neurollm_sessions_active"] == 0 and m["neurollm_kv_cache_bytes"] == 0:
            break
        time.sleep(0.2)
    check(m["neurollm_sessions_active"] == 0 and m["neurollm_kv_cache_bytes"] == 0,
          "the dropped client's session and KV cache are freed")
    check(m["neurollm_generations_cancelled_total"] >= 1 and
          m["neurollm_tokens_generated_total"] - start < 200, "its generation was cancelled, not run out")


def test_embeddings_models_events(s, model):
    code, r = s.json("/v1/embeddings", {"input": ["the cat", [1, 2, 3]]})
    check(code == 200 and len(r["data"]) == 2, "two embeddings")
    if code == 200:
        v = r["data"][0]["embedding"]
        check(len(v) == 128 and abs(sum(x * x for x in v) - 1) < 1e-4, "a unit vector of d")
        code2, r2 = s.json("/v1/embeddings", {"input": "the cat"})
        check(r2["data"][0]["embedding"] == v, "the same input, the same vector")
        check(r["usage"]["prompt_tokens"] == 10, "usage counts tokens")
    code, r = s.json("/v1/models")
    check(code == 200 and r["data"][0]["id"] == os.path.basename(model), "/v1/models")
    code, r = s.json("/api/status")
    check(code == 200 and len(r["nodes"]) == 1 and r["nodes"][0]["layers"] == [0, 4],
          "/api/status: one node with 4 layers")
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    sock.sendall(b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    got = b""
    while b"event: request" not in got or b"event: start" not in got:
        d = sock.recv(65536)
        if not d:
            break
        got += d
    sock.close()
    check(b"text/event-stream" in got and b"event: start" in got and b"event: request" in got,
          "/api/events replays start and request events")


def test_adapter(model, tmp):
    """serve --adapter: the adapter is merged into the served weights; greedy
    completions give the ids of generate --adapter (unmerged: equal within
    float rounding, which greedy decoding does not see here)."""
    data, ad = os.path.join(tmp, "data.txt"), os.path.join(tmp, "ad.safetensors")
    with open(data, "w") as f:
        f.write(open(os.path.join(SRC, "tests", "data", "corpus.txt"), "rb").read()[:32340].decode())
    subprocess.run([NEUROCTL, "finetune", "--model", model, "--data", data, "--steps", "8",
                    "--batch", "4", "--seq", "32", "--lr", "3e-2", "--lora-rank", "4",
                    "--lora-targets", "wq,wv,wo,w_up", "--threads", "2", "--device", DEVICE,
                    "--out", ad], check=True, capture_output=True)
    s = Server(model, "--adapter", ad)
    try:
        code, r = s.json("/v1/models")
        check(code == 200 and [m["id"] for m in r["data"]] == ["m.safetensors+ad.safetensors"],
              "/v1/models names the model and its adapter: %s" % r)
        moved = False
        for prompt in ([1, 2, 3], list(range(40, 75))):
            want = generate_ids(model, prompt, 16, 0.0, 1.0, 0, "--adapter", ad)
            base = generate_ids(model, prompt, 16, 0.0, 1.0, 0)
            moved |= want != base
            r = completion(s, prompt, 16, 0.0, 1.0, 0, model="anything")
            if r:
                got = r["choices"][0]["token_ids"]
                check(got == want, "serve --adapter ids %s equal generate --adapter's %s" %
                      (got, want))
                check(r["model"] == "m.safetensors+ad.safetensors", "the answer names the pair")
        check(moved, "the adapter changes what is generated")
    finally:
        check(s.stop() == 0, "serve --adapter stops cleanly")
    r = subprocess.run([NEUROCTL, "serve", "--model", model, "--adapter", data, "--http",
                        "127.0.0.1:0"], capture_output=True, text=True, timeout=30)
    check(r.returncode != 0 and "--adapter: " + data in r.stderr,
          "a file that is not an adapter is refused: %s" % r.stderr.strip())


def test_limits(model, tmp):
    # 429 past --max-requests
    s = Server(model, "--max-requests", "1")
    try:
        sock = socket.create_connection(("127.0.0.1", s.port))
        body = json.dumps(dict(prompt=[1], max_tokens=200, stream=True)).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n"
                     % len(body) + body)
        sock.recv(100)
        code, r = s.json("/v1/completions", {"prompt": [1], "max_tokens": 1})
        check(code == 429 and "already" in r["error"]["message"], "429 past the bound (%s)" % code)
        sock.close()
    finally:
        s.stop()
    # bearer tokens; a slow client is cut off
    toks = os.path.join(tmp, "tokens")
    with open(toks, "w") as f:
        f.write("# tokens\nsecret-token-0123456789\n")
    os.chmod(toks, 0o644)
    r = subprocess.run([NEUROCTL, "serve", "--model", model, "--http", "127.0.0.1:0",
                        "--http-tokens", toks], capture_output=True, text=True, timeout=30)
    check(r.returncode != 0 and "chmod 600" in r.stderr,
          "a tokens file others may read is refused: %s" % r.stderr.strip())
    os.chmod(toks, 0o600)
    s = Server(model, "--http-tokens", toks, "--http-timeout", "2")
    try:
        code, r = s.json("/v1/models")
        check(code == 401 and "token" in r["error"]["message"], "no token -> 401")
        code, r = s.json("/metrics", headers={"Authorization": "Bearer secret-token-0123456788"})
        check(code == 401, "a wrong token -> 401")
        code, r = s.json("/v1/models", headers={"Authorization": "Bearer secret-token-0123456789"})
        check(code == 200, "the right token -> 200")
        code, _ = s.request("/")
        check(code == 200, "the page itself needs no token")
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=15)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t0 = time.time()
        try:
            closed = sock.recv(100) == b""
        except (ConnectionResetError, socket.timeout):
            closed = True
        check(closed and time.time() - t0 < 10, "a slow client is cut off after --http-timeout")
    finally:
        s.stop()
    r = subprocess.run([NEUROCTL, "serve", "--model", model, "--http", "0.0.0.0:0"],
                       capture_output=True, text=True, timeout=30)
    check(r.returncode != 0 and "--http-tokens" in r.stderr,
          "binding off loopback without tokens is refused: %s" % r.stderr.strip())


def test_odd_name(model, tmp):
    # issue 31: the model's file name goes into /api/status and the events
    # as a JSON string, escaped, whatever bytes it holds
    odd = os.path.join(tmp, 'we"ird\\name\x01.safetensors')
    shutil.copyfile(model, odd)
    s = Server(odd)
    try:
        code, r = s.json("/api/status")
        check(code == 200 and r["model"]["name"] == os.path.basename(odd),
              "/api/status names the odd model file: %s" % (r,))
    finally:
        s.stop()


def main():
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "m.safetensors")
        subprocess.run([NEUROCTL, "init", "--config", os.path.join(SRC, "configs", "tiny.yaml"),
                        "--out", model, "--seed", "3"], check=True, capture_output=True)
        s = Server(model, "--prefill-chunk", "16")
        try:
            test_equal_generate(s, model)
            test_concurrent(s)
            test_bad_requests(s)
            test_dropped_client(s)
            test_embeddings_models_events(s, model)
            if len(sys.argv) > 1:
                with open(sys.argv[1], "w") as f:
                    f.write(s.request("/metrics")[1].decode())
        finally:
            rc = s.stop()
            check(rc == 0, "serve stops cleanly on SIGTERM (rc %s)" % rc)
        test_limits(model, tmp)
        test_adapter(model, tmp)
        test_odd_name(model, tmp)
    print("test_serve: %d failed" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
