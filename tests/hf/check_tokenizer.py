"""Our tokenizer against Hugging Face's `tokenizers` library (and
transformers' AutoTokenizer), both ways, on text with accents, curly
quotes, dashes, CJK, emoji, digits and whitespace runs:

1. a tokenizer trained here (Unicode classes), exported with the model
   by `neuroctl export --format hf`: AutoTokenizer and tokenizers load the
   directory and give the ids `neuroctl tokenizer encode` gives;
2. the same for a version 1 tokenizer (byte classes, exported as a Split
   regex);
3. a byte-level BPE made by the `tokenizers` library (ids of its own:
   its special token first), put in a Hugging Face model directory as
   tokenizer.json, and as vocab.json + merges.txt: `neuroctl import --hf`
   reads it and our encode gives its ids; exported again, AutoTokenizer
   gives them too;
4. a Unigram tokenizer.json (SentencePiece's kind) is named and left out,
   and the weights import without it.
Decoding round-trips everywhere. Usage: check_tokenizer.py NEUROCTL TMPDIR
"""
import json
import os
import shutil
import subprocess
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

N, TMP = sys.argv[1], sys.argv[2]
fails = 0
checks = 0

SAMPLES = [
    "don\u2019t won\u2019t it\u2019s",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00c5ngstr\u00f6m \u00fcber stra\u00dfe",
    "\u201cquoted\u201d \u2018single\u2019 \u2014 em dash \u2013 en dash - hyphen",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \u4e2d\u6587 \ud55c\uad6d\uc5b4 2024\u5e74",
    "emoji \U0001F600\U0001F600 \U0001F468\u200d\U0001F469\u200d\U0001F467 \u2764\ufe0f ok",
    "digits 12345 3.14159 \u00bd \u00b2 \u2460 \u0663\u0664",
    "whitespace  runs\t\ttabs\n\n\nlines   \u3000ideographic\u00a0nbsp \n",
    "I'm we'll they've O'Neil's 'quoted' e\u0301t\u00e9",
    "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440 \u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",
]
TEXT = "\n".join(SAMPLES)


def check(ok, what):
    global fails, checks
    checks += 1
    if not ok:
        fails += 1
        print("FAIL:", what, flush=True)


def run(*args, stdin=None):
    r = subprocess.run([N, *args], input=stdin, capture_output=True)
    if r.returncode != 0:
        raise SystemExit("neuroctl %s: %s" % (" ".join(args), r.stderr.decode(errors="replace")))
    return r


def ours_encode(tok, text):
    return [int(x) for x in run("tokenizer", "encode", "--tokenizer", tok,
                                stdin=text.encode()).stdout.split()]


def ours_decode(tok, ids):
    return run("tokenizer", "decode", "--tokenizer", tok,
               stdin=" ".join(map(str, ids)).encode()).stdout.decode()


def compare(label, tok, hf_dir, hf_json=None):
    """Each sample and the whole text: our ids == the library's, and both
    decode back to the text."""
    auto = AutoTokenizer.from_pretrained(hf_dir)
    lib = Tokenizer.from_file(hf_json or os.path.join(hf_dir, "tokenizer.json"))
    for i, s in enumerate(SAMPLES + [TEXT]):
        ours = ours_encode(tok, s)
        theirs = lib.encode(s, add_special_tokens=False).ids
        auto_ids = auto.encode(s, add_special_tokens=False)
        check(ours == theirs, "%s: sample %d: ours %s, tokenizers %s" % (label, i, ours, theirs))
        check(auto_ids == theirs, "%s: sample %d: AutoTokenizer %s" % (label, i, auto_ids))
        check(ours_decode(tok, ours) == s, "%s: sample %d: our decode" % (label, i))
        check(lib.decode(theirs, skip_special_tokens=False) == s,
              "%s: sample %d: the library's decode" % (label, i))
    return auto


CORPUS = os.path.join(TMP, "corpus.txt")
with open(CORPUS, "w", encoding="utf-8") as f:
    for k in range(40):
        f.write(TEXT + " " + str(k) + "\n")
    for k in range(300):  # some English, none of it a special's name
        f.write("the quick brown fox %d jumps over the lazy dog's back, doesn't it?\n" % k)
CFG = os.path.join(TMP, "cfg.yaml")
with open(CFG, "w") as f:
    f.write("hidden_dim: 32\nnum_layers: 1\nnum_heads: 4\nnum_kv_heads: 2\nffn_dim: 48\n"
            "num_experts: 1\ntop_k: 1\nmax_seq_len: 64\n")


def model_with(tok, name):
    m = os.path.join(TMP, name + ".safetensors")
    run("init", "--config", CFG, "--tokenizer", tok, "--out", m, "--seed", "1")
    d = os.path.join(TMP, name + "-hf")
    run("export", "--format", "hf", "--model", m, "--out", d)
    return m, d


# 1. trained here, Unicode classes
tok = os.path.join(TMP, "tok.bpe")
run("tokenizer", "train", "--input", CORPUS, "--vocab-size", "900", "--out", tok, "--quiet")
_, d1 = model_with(tok, "uni")
for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
    check(os.path.exists(os.path.join(d1, name)), "export wrote " + name)
auto = compare("trained here", tok, d1)
check(len(ours_encode(tok, SAMPLES[0])) >= 9, "don't won't it's: at least the 9 words of GPT-2's rule")
check(auto.bos_token == "<|begin|>" and auto.eos_token_id == 257, "bos/eos in tokenizer_config")

# 2. a version 1 tokenizer (byte classes) keeps them through the export
v1 = os.path.join(TMP, "v1.bpe")
with open(v1, "w") as f:
    f.write("neurollm-bpe 1\nmerges 0\n")
run("tokenizer", "learn", "--tokenizer", v1, "--input", CORPUS, "--add", "500", "--quiet")
check(open(v1).readline() == "neurollm-bpe 1\n", "learning keeps version 1")
_, d2 = model_with(v1, "bytes")
compare("version 1", v1, d2)
check(len(ours_encode(v1, SAMPLES[0])) < 11, "version 1 keeps curly quotes inside words")

# 3. made by the tokenizers library, imported
lib = Tokenizer(models.BPE())
lib.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
lib.decoder = decoders.ByteLevel()
lib.train([CORPUS], trainers.BpeTrainer(vocab_size=450, special_tokens=["<|endoftext|>"],
                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                        show_progress=False))
check(lib.token_to_id("<|endoftext|>") == 0, "the library puts its special first")
src = os.path.join(TMP, "lib-hf")
shutil.copytree(d1, src)
for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
             "neurollm-tokenizer.txt"):
    os.remove(os.path.join(src, name))
lib.save(os.path.join(src, "tokenizer.json"))
imp = os.path.join(TMP, "imported.safetensors")
r = run("import", "--hf", src, "--out", imp)
check(b"tokenizer: tokenizer.json: byte-level BPE" in r.stderr, "import reports the tokenizer: %s"
      % r.stderr.decode())
compare("imported tokenizer.json", imp, src)
n_model = json.load(open(os.path.join(src, "config.json")))["vocab_size"]
check(ours_decode(imp, [n_model - 1]) == "<|unused_%d|>" % (n_model - 1),
      "rows past the library's ids: unused specials")
check(ours_decode(imp, [0]) == "<|endoftext|>", "an added token decodes to its content")
# exported again: ids kept where the library put them
d3 = os.path.join(TMP, "reexported-hf")
run("export", "--format", "hf", "--model", imp, "--out", d3)
compare("re-exported", imp, d3, os.path.join(src, "tokenizer.json"))
# vocab.json + merges.txt (GPT2Tokenizer's files) without tokenizer.json
os.remove(os.path.join(src, "tokenizer.json"))
lib.model.save(src)
imp2 = os.path.join(TMP, "imported2.safetensors")
run("import", "--hf", src, "--out", imp2)
for i, s in enumerate(SAMPLES):
    check(ours_encode(imp2, s) == lib.encode(s, add_special_tokens=False).ids,
          "vocab.json + merges.txt: sample %d" % i)

# 4. a Unigram (SentencePiece) tokenizer: named, left out, weights imported
uni = Tokenizer(models.Unigram())
uni.train([CORPUS], trainers.UnigramTrainer(vocab_size=300, show_progress=False))
for name in ("vocab.json", "merges.txt"):
    os.remove(os.path.join(src, name))
uni.save(os.path.join(src, "tokenizer.json"))
imp3 = os.path.join(TMP, "imported3.safetensors")
r = run("import", "--hf", src, "--out", imp3)
check(b"model Unigram" in r.stderr and b"imported without a tokenizer" in r.stderr,
      "unigram named: %s" % r.stderr.decode())
r = subprocess.run([N, "tokenizer", "encode", "--tokenizer", imp3], input=b"x",
                   capture_output=True)
check(r.returncode == 1 and b"carries no tokenizer" in r.stderr, "no tokenizer in the checkpoint")

print("check_tokenizer: %d checks, %d failed" % (checks, fails))
sys.exit(1 if fails else 0)
