"""The official `openai` Python client (pinned in scripts/install-deps.sh)
against `neuroctl serve` and against `neurocoord --http` on a 3-node local
cluster, every call issue 32 names, with values checked:

  models.list            the served model is listed
  completions            greedy text; the stream's text equals it; a stop
                         string cuts it there (finish "stop"); n=2 with a
                         seed: choice i equals a lone request with seed + i,
                         and the request repeats; logprobs=2 (serve): every
                         logprob <= 0, the chosen one is the top one
                         (greedy); a cluster answers 501 naming logprobs
  chat.completions       greedy content equals the completion of the prompt
                         the documented default template renders; the
                         stream (with include_usage: a last chunk with no
                         choices and the usage) gives the same content;
                         n=2 seeded repeats; logprobs/top_logprobs as
                         above; max_completion_tokens bounds the answer
  embeddings             the client's default (base64) decodes to exactly
                         the floats of encoding_format="float"
  refusals               an unknown field is refused with 400 naming it
  models.retrieve        the served model by its id; another is 404
  what OpenAI accepts    a chat that names no max_tokens runs to the
                         context's end; top_p=0 is greedy; without a seed
                         two requests sample differently; a negative seed,
                         response_format {"type": "text"} and an empty
                         logit_bias are taken; a stop string of two tokens
                         streams no part of itself (the streamed text is
                         the whole answer's); an error body carries "code"
                         and a message valid in UTF-8 where the field name
                         it quotes was cut inside a character

Run with the venv's python (tests/test_openai_client.sh makes sure of it).
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

import openai

B = os.environ.get("NL_BUILD_DIR", "build")
N = os.path.join(B, "cli", "neuroctl")
DEV = os.environ.get("NL_TEST_DEVICE", "cpu")
fails = 0


def check(cond, msg):
    global fails
    if not cond:
        fails += 1
        print("FAIL:", msg, file=sys.stderr)
    return cond


def chatml(msgs):
    """docs/serving.md, "Chat templates": the default (ChatML, no BOS)."""
    return "".join("<|im_start|>%s\n%s<|im_end|>\n" % (m["role"], m["content"]) for m in msgs) + \
        "<|im_start|>assistant\n"


def check_logprobs(tops, chosen, label):
    """Each position: logprob <= 0, at most 2 alternatives, the chosen one the top (greedy)."""
    check(len(chosen) > 0, label + ": logprobs present")
    for lp, top in zip(chosen, tops):
        check(lp <= 0.0, "%s: logprob %g <= 0" % (label, lp))
        check(1 <= len(top) <= 2 and all(t <= 0.0 for t in top), "%s: top %s" % (label, top))
        check(abs(max(top) - lp) < 1e-6, "%s: greedy takes the top one (%g, %s)" % (label, lp, top))


def completions(cl, model):
    kw = dict(model=model, prompt="The cat", max_tokens=12, temperature=0)
    r = cl.completions.create(**kw)
    text = r.choices[0].text
    check(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12,
          "completion: length, 12 tokens: %s" % r)
    streamed = "".join(c.choices[0].text for c in cl.completions.create(stream=True, **kw)
                       if c.choices)
    check(streamed == text, "completion stream %r equals %r" % (streamed, text))
    # a stop string from the text: an ASCII character (a byte-level model's
    # text has U+FFFD for bytes that are not UTF-8, which no stop matches)
    at = [i for i, ch in enumerate(text) if i > 0 and " " <= ch <= "~"]
    stop = text[at[0]] if at else ""
    if check(stop != "", "a stop string from the text %r" % text):
        s = cl.completions.create(stop=[stop], **kw)
        check(s.choices[0].finish_reason == "stop" and s.choices[0].text == text[:text.find(stop)],
              "stop %r cuts %r: %r" % (stop, text, s.choices[0].text))
    sk = dict(model=model, prompt="The cat", max_tokens=10, temperature=1.0)
    two = cl.completions.create(n=2, seed=11, **sk)
    again = cl.completions.create(n=2, seed=11, **sk)
    check([c.text for c in two.choices] == [c.text for c in again.choices] and
          [c.index for c in two.choices] == [0, 1], "n=2 with a seed repeats")
    for i in range(2):
        lone = cl.completions.create(seed=11 + i, **sk).choices[0].text
        check(two.choices[i].text == lone, "choice %d uses seed + %d" % (i, i))
    check(two.usage.completion_tokens == 20, "usage counts both choices")
    lp = cl.completions.create(logprobs=2, **kw).choices[0]
    check(lp.text == text, "logprobs do not change the text")
    check(len(lp.logprobs.tokens) == 12 and len(lp.logprobs.text_offset) == 12,
          "a logprob per token")
    check_logprobs([list(t.values()) for t in lp.logprobs.top_logprobs],
                   lp.logprobs.token_logprobs, "completions logprobs")
    return lp.logprobs.token_logprobs


def chat(cl, model):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    kw = dict(model=model, messages=msgs, max_tokens=10, temperature=0)
    r = cl.chat.completions.create(**kw)
    content = r.choices[0].message.content
    check(r.object == "chat.completion" and r.choices[0].message.role == "assistant",
          "a chat.completion: %s" % r)
    want = cl.completions.create(model=model, prompt=chatml(msgs), max_tokens=10, temperature=0)
    check(content == want.choices[0].text and r.usage.prompt_tokens == want.usage.prompt_tokens,
          "greedy chat %r equals the completion of the rendered prompt %r" %
          (content, want.choices[0].text))
    chunks = list(cl.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                             **kw))
    got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(got == content, "chat stream %r equals %r" % (got, content))
    last = chunks[-1]
    check(last.choices == [] and last.usage is not None and last.usage.completion_tokens == 10,
          "include_usage: a last chunk with the usage: %s" % last)
    check(all(c.object == "chat.completion.chunk" for c in chunks), "chunk objects")
    check([c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length",
          "the stream's finish")
    sk = dict(model=model, messages=msgs, max_tokens=8, temperature=1.0, seed=5, n=2)
    a, b = cl.chat.completions.create(**sk), cl.chat.completions.create(**sk)
    check([c.message.content for c in a.choices] == [c.message.content for c in b.choices] and
          len(a.choices) == 2, "chat n=2 with a seed repeats")
    m = cl.chat.completions.create(model=model, messages=msgs, max_completion_tokens=3,
                                   temperature=0)
    check(m.usage.completion_tokens == 3 and m.choices[0].finish_reason == "length",
          "max_completion_tokens=3: %s" % m.usage)
    lp = cl.chat.completions.create(logprobs=True, top_logprobs=2, **kw).choices[0]
    check(lp.message.content == content and len(lp.logprobs.content) == 10,
          "chat logprobs per token")
    check_logprobs([[t.logprob for t in c.top_logprobs] for c in lp.logprobs.content],
                   [c.logprob for c in lp.logprobs.content], "chat logprobs")


def embeddings_and_refusals(cl, model):
    e64 = cl.embeddings.create(model=model, input=["hello world", "bye"])  # the client: base64
    ef = cl.embeddings.create(model=model, input=["hello world", "bye"], encoding_format="float")
    for a, b in zip(e64.data, ef.data):
        check(len(a.embedding) > 0 and a.embedding == b.embedding,
              "base64 decodes to the float answer (%d floats)" % len(a.embedding))
    try:
        cl.completions.create(model=model, prompt="x", max_tokens=1, extra_body={"bogus": 1})
        check(False, "an unknown field is refused")
    except openai.BadRequestError as e:
        check("bogus" in str(e), "the refusal names the field: %s" % e)


def openai_rules(cl, url, model):
    check(cl.models.retrieve(model).id == model, "models.retrieve(%r)" % model)
    try:
        cl.models.retrieve("no-such-model")
        check(False, "models.retrieve of another id is refused")
    except openai.NotFoundError:
        pass
    msgs = [{"role": "user", "content": "Hi"}]
    full = cl.chat.completions.create(model=model, messages=msgs, temperature=0)
    check(full.choices[0].finish_reason == "length" and
          full.usage.prompt_tokens + full.usage.completion_tokens == 256,
          "a chat without max_tokens runs to the context's end (256): %s" % full.usage)
    kw = dict(model=model, prompt="The cat", max_tokens=12)
    greedy = cl.completions.create(temperature=0, **kw).choices[0].text
    check(cl.completions.create(temperature=1.0, top_p=0, **kw).choices[0].text == greedy,
          "top_p=0 is greedy")
    r = cl.chat.completions.create(model=model, messages=msgs, max_tokens=2, seed=-3,
                                   response_format={"type": "text"}, logit_bias={})
    check(r.usage.completion_tokens == 2, "a negative seed, response_format text, logit_bias {}")
    sampled = dict(model=model, prompt="The cat", max_tokens=24, temperature=1.0)
    check(cl.completions.create(**sampled).choices[0].text !=
          cl.completions.create(**sampled).choices[0].text,
          "without a seed, a request samples afresh")
    # a stop string of two characters: two tokens of a byte-level model,
    # from a sampled text (a random model's greedy bytes are seldom ASCII)
    for seed in range(1, 9):
        sk = dict(model=model, prompt="The cat", max_tokens=40, temperature=1.0, seed=seed)
        text = cl.completions.create(**sk).choices[0].text
        at = [i for i in range(1, len(text) - 1)
              if " " <= text[i] <= "~" and " " <= text[i + 1] <= "~"]
        if at:
            break
    if check(at != [], "two printable characters in %r" % text):
        stop = text[at[0]:at[0] + 2]
        whole = cl.completions.create(stop=stop, **sk).choices[0].text
        streamed = "".join(c.choices[0].text for c in
                           cl.completions.create(stop=stop, stream=True, **sk) if c.choices)
        check(whole == text[:text.find(stop)] and streamed == whole,
              "stop %r: streamed %r, whole %r" % (stop, streamed, whole))
    # a field name of 46 ASCII bytes then e-acute: the error quotes it cut
    body = ('{"prompt": "x", "%s": 1}' % ("a" * 46 + "\u00e9" * 5)).encode()
    req = urllib.request.Request(url + "v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=60)
        check(False, "an unknown field is refused")
    except urllib.error.HTTPError as e:
        import json
        err = json.loads(e.read().decode("utf-8"))["error"]
        check(e.code == 400 and "code" in err and err["type"] == "invalid_request_error" and
              err["message"].startswith("aaaa") and "param" in err,
              "the error body: %s" % err)


def drive(url, label):
    cl = openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=180)
    models = [m.id for m in cl.models.list().data]
    check(len(models) >= 1, "%s: models.list: %s" % (label, models))
    lps = completions(cl, models[0])
    chat(cl, models[0])
    embeddings_and_refusals(cl, models[0])
    openai_rules(cl, url, models[0])
    return lps


def main():
    w = tempfile.mkdtemp()
    serve, serve_lps = None, []
    try:
        with open(w + "/cfg.yaml", "w") as f:  # tiny, byte-level: fast on 2 shared cores
            f.write("hidden_dim: 64\nnum_layers: 6\nnum_heads: 4\nnum_kv_heads: 2\nffn_dim: 64\n"
                    "num_experts: 4\nvocab_size: 256\nvocab_chunk: 256\nmax_seq_len: 256\n")
        subprocess.run([N, "init", "--config", w + "/cfg.yaml", "--out", w + "/m.safetensors",
                        "--seed", "7"], check=True, stdout=subprocess.DEVNULL)
        serve = subprocess.Popen([N, "serve", "--model", w + "/m.safetensors", "--http",
                                  "127.0.0.1:0", "--threads", "1", "--device", DEV],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        m = re.search(r"(http://127\.0\.0\.1:\d+/)", serve.stdout.readline())
        if check(m is not None, "neuroctl serve started"):
            serve_lps = drive(m.group(1), "serve")
        serve.terminate()
        serve.wait(30)
        out = subprocess.run([N, "cluster", "up", "--device", DEV, "--dir", w + "/c", "--nodes",
                              "3", "--model", w + "/m.safetensors", "--memory", "64M",
                              "--threads", "1", "--http", "127.0.0.1:0", "--timeout", "60"],
                             check=True, capture_output=True, text=True).stdout
        m = re.search(r"http: (http://[0-9.:]+/)", out)
        if check(m is not None, "cluster up prints the HTTP address: " + out):
            cluster_lps = drive(m.group(1), "cluster")
            # the same model in one process and on the stages: the same
            # log-probabilities within float rounding (the GEMMs differ)
            check(len(serve_lps) == len(cluster_lps) and
                  all(abs(a - b) < 1e-4 for a, b in zip(serve_lps, cluster_lps)),
                  "cluster logprobs %s equal serve's %s" % (cluster_lps, serve_lps))
    finally:
        if serve and serve.poll() is None:
            serve.kill()
        subprocess.run([N, "cluster", "down", "--dir", w + "/c"], capture_output=True)
        shutil.rmtree(w, ignore_errors=True)
    print("test_openai_client: %s" % ("ok" if not fails else "%d failures" % fails))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
