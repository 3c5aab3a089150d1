#!/usr/bin/env python3
"""Check neuroctl import/export --format hf against transformers itself.

Run by tests/test_hf_transformers.sh in the venv scripts/install-deps.sh
makes (.venv-hf: transformers over Debian's python3-torch). Usage:

    check_hf.py NEUROCTL WORKDIR

1. A random small MixtralForCausalLM (odd sizes, rope_theta 1e6, random
   norms), saved sharded in F32 and single-file in BF16, is imported; our
   logits (neuroctl forward) match transformers' on the same ids within
   1e-4 relative (BF16: against transformers running the same BF16
   weights upcast to F32).
2. A model of ours (neuroctl init with a tokenizer, three training steps)
   is exported, loaded with from_pretrained: same logits within 1e-4;
   GPT2Tokenizer reads the exported vocab.json / merges.txt and encodes
   ASCII text as our tokenizer does.
3. import -> export -> import gives bit-identical tensors and config.
4. Llama: the dense FFN both ways.
5. Mistral with sliding_window 4 (and hidden_act "swish") over 11 tokens,
   which the window changes: imported, our logits match transformers'
   (eager attention); exported back it is a MistralForCausalLM with
   sliding_window 4 and the same logits.
"""
import copy
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import (GPT2Tokenizer, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, MixtralConfig, MixtralForCausalLM)

TOL = 1e-4
NEUROCTL, WORK = sys.argv[1], sys.argv[2]
os.makedirs(WORK, exist_ok=True)
failures = []


def run(*args, stdin=None):
    p = subprocess.run([NEUROCTL, *args], input=stdin, capture_output=True)
    if p.returncode != 0:
        sys.exit(f"neuroctl {' '.join(args)} failed ({p.returncode}):\n{p.stderr.decode()}")
    return p


def path(name):
    return os.path.join(WORK, name)


def our_logits(model, ids):
    save_file({"tokens": ids.to(torch.int64).contiguous()}, path("tokens.safetensors"))
    run("forward", "--model", model, "--tokens", path("tokens.safetensors"), "--out",
        path("logits.safetensors"), "--threads", "2")
    return load_file(path("logits.safetensors"))["logits"].double()


def compare(what, ours, theirs):
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    ok = rel <= TOL and ours.shape == theirs.shape
    print(f"{'ok  ' if ok else 'FAIL'} {what}: shape {tuple(ours.shape)}, max relative error {rel:.2e}")
    if not ok:
        failures.append(what)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


torch.manual_seed(19)
ids = torch.randint(0, 67, (2, 11))

# ---- 1. import a transformers model
cfg = MixtralConfig(vocab_size=67, hidden_size=60, intermediate_size=37, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, num_local_experts=5,
                    num_experts_per_tok=2, max_position_embeddings=128, rope_theta=1e6,
                    rms_norm_eps=1e-5, tie_word_embeddings=False)
hf = MixtralForCausalLM(cfg).eval()
with torch.no_grad():
    for name, p in hf.named_parameters():
        p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.2) +
                (1.0 if "norm" in name else 0.0))
hf.save_pretrained(path("hf-f32"), safe_serialization=True, max_shard_size="200KB")
assert os.path.exists(path("hf-f32/model.safetensors.index.json")), "expected a sharded save"
run("import", "--hf", path("hf-f32"), "--out", path("imported.safetensors"))
compare("import (sharded F32) vs transformers", our_logits(path("imported.safetensors"), ids),
        hf_logits(hf, ids))

hf.to(torch.bfloat16).save_pretrained(path("hf-bf16"), safe_serialization=True)
hf_bf = MixtralForCausalLM.from_pretrained(path("hf-bf16"), torch_dtype=torch.float32).eval()
p = run("import", "--hf", path("hf-bf16"), "--out", path("imported-bf16.safetensors"))
if b"BF16" not in p.stderr:
    failures.append("BF16 import does not say it converted")
compare("import (BF16) vs transformers on the same weights",
        our_logits(path("imported-bf16.safetensors"), ids), hf_logits(hf_bf, ids))

# ---- 2. export one of ours (trained a little, with a tokenizer)
text = ("The quick brown fox jumps over the lazy dog. " * 40 +
        "Pack my box with five dozen liquor jugs! 12345 " * 40).encode()
with open(path("corpus.txt"), "wb") as f:
    f.write(text)
run("tokenizer", "train", "--input", path("corpus.txt"), "--vocab-size", "300", "--out",
    path("tok.txt"), "--quiet")
with open(path("ours.yaml"), "w") as f:
    f.write("hidden_dim: 36\nnum_layers: 2\nnum_heads: 6\nnum_kv_heads: 3\nffn_dim: 29\n"
            "num_experts: 3\ntop_k: 2\nmax_seq_len: 64\nrope_base: 1000000\n")
run("init", "--config", path("ours.yaml"), "--out", path("ours-init.safetensors"), "--seed", "7",
    "--tokenizer", path("tok.txt"))
run("train", "--model", path("ours-init.safetensors"), "--data", path("corpus.txt"), "--steps", "3",
    "--batch", "2", "--seq", "16", "--lr", "1e-2", "--threads", "2", "--out",
    path("ours.safetensors"), "--checkpoint-dir", path("ckpts"))
run("export", "--format", "hf", "--model", path("ours.safetensors"), "--out", path("hf-ours"),
    "--shard-size", "20K")
ours_vocab = json.load(open(path("hf-ours/config.json")))["vocab_size"]
mine = MixtralForCausalLM.from_pretrained(path("hf-ours")).eval()
ids2 = torch.randint(0, ours_vocab, (2, 13))
compare("export vs transformers from_pretrained", our_logits(path("ours.safetensors"), ids2),
        hf_logits(mine, ids2))

gpt2 = GPT2Tokenizer(path("hf-ours/vocab.json"), path("hf-ours/merges.txt"))
sample = "The lazy fox packs five dozen jugs. 12345"
theirs = gpt2.encode(sample)
p = run("tokenizer", "encode", "--tokenizer", path("hf-ours/neurollm-tokenizer.txt"),
        stdin=sample.encode())
ours_ids = [int(x) for x in p.stdout.split()]
ok = ours_ids == theirs
print(f"{'ok  ' if ok else 'FAIL'} exported vocabulary: GPT2Tokenizer encodes {len(theirs)} ids "
      f"as ours does")
if not ok:
    print(f"  ours   {ours_ids}\n  theirs {theirs}")
    failures.append("vocabulary")

# ---- 3. import -> export -> import is exact
run("export", "--format", "hf", "--model", path("imported.safetensors"), "--out", path("hf-again"))
run("import", "--hf", path("hf-again"), "--out", path("again.safetensors"))
a, b = load_file(path("imported.safetensors")), load_file(path("again.safetensors"))
same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
print(f"{'ok  ' if same else 'FAIL'} import -> export -> import: {len(a)} tensors bit-identical")
if not same:
    failures.append("round trip")

# ---- 4. Llama: the dense FFN (one expert, no router) both ways
lcfg = LlamaConfig(vocab_size=67, hidden_size=60, intermediate_size=37, num_hidden_layers=3,
                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                   rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False)
llama = LlamaForCausalLM(lcfg).eval()
with torch.no_grad():
    for name, p in llama.named_parameters():
        p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.2) +
                (1.0 if "norm" in name else 0.0))
llama.save_pretrained(path("hf-llama"), safe_serialization=True)
run("import", "--hf", path("hf-llama"), "--out", path("llama.safetensors"))
compare("import LlamaForCausalLM vs transformers", our_logits(path("llama.safetensors"), ids),
        hf_logits(llama, ids))
with open(path("dense.yaml"), "w") as f:
    f.write("hidden_dim: 36\nnum_layers: 2\nnum_heads: 6\nnum_kv_heads: 3\nffn_dim: 29\n"
            "num_experts: 1\ntop_k: 1\nmax_seq_len: 64\nrope_base: 10000\nvocab_size: 300\n")
run("init", "--config", path("dense.yaml"), "--out", path("dense.safetensors"), "--seed", "5")
run("export", "--format", "hf", "--model", path("dense.safetensors"), "--out", path("hf-dense"))
arch = json.load(open(path("hf-dense/config.json")))["architectures"][0]
if arch != "LlamaForCausalLM":
    failures.append("a dense model exports as " + arch)
mine = LlamaForCausalLM.from_pretrained(path("hf-dense")).eval()
ids3 = torch.randint(0, 300, (2, 13))
compare("dense export vs LlamaForCausalLM from_pretrained", our_logits(path("dense.safetensors"), ids3),
        hf_logits(mine, ids3))
run("export", "--format", "hf", "--model", path("llama.safetensors"), "--out", path("hf-llama2"))
run("import", "--hf", path("hf-llama2"), "--out", path("llama2.safetensors"))
a, b = load_file(path("llama.safetensors")), load_file(path("llama2.safetensors"))
same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
print(f"{'ok  ' if same else 'FAIL'} Llama import -> export -> import: {len(a)} tensors bit-identical")
if not same:
    failures.append("Llama round trip")

# ---- 5. Mistral's sliding_window: our attention_window on every layer, both
# ways (eager attention: transformers 4.38 applies the window's mask there)
mcfg = MistralConfig(vocab_size=67, hidden_size=60, intermediate_size=37, num_hidden_layers=2,
                     num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                     rope_theta=1e4, rms_norm_eps=1e-5, sliding_window=4, hidden_act="swish",
                     tie_word_embeddings=False)
mcfg._attn_implementation = "eager"
mistral = MistralForCausalLM(mcfg).eval()
with torch.no_grad():
    for name, p in mistral.named_parameters():
        p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.2) +
                (1.0 if "norm" in name else 0.0))
mistral.save_pretrained(path("hf-mistral"), safe_serialization=True)
run("import", "--hf", path("hf-mistral"), "--out", path("mistral.safetensors"))
compare("import MistralForCausalLM (sliding_window 4, swish) vs transformers",
        our_logits(path("mistral.safetensors"), ids), hf_logits(mistral, ids))
fcfg = copy.deepcopy(mcfg)  # the model holds mcfg itself
fcfg.sliding_window = None
full = MistralForCausalLM(fcfg).eval()
full.load_state_dict(mistral.state_dict())
rel = ((hf_logits(full, ids) - hf_logits(mistral, ids)).abs().max()).item()
if rel < 1e-3:
    failures.append("the window of 4 changes nothing over 11 tokens: the test proves nothing")
run("export", "--format", "hf", "--model", path("mistral.safetensors"), "--out", path("hf-mistral2"))
back = json.load(open(path("hf-mistral2/config.json")))
if back["architectures"][0] != "MistralForCausalLM" or back["sliding_window"] != 4:
    failures.append("a windowed dense model exports as %s, sliding_window %s"
                    % (back["architectures"][0], back["sliding_window"]))
mine = MistralForCausalLM.from_pretrained(path("hf-mistral2"), attn_implementation="eager").eval()
compare("windowed export vs MistralForCausalLM from_pretrained",
        our_logits(path("mistral.safetensors"), ids), hf_logits(mine, ids))

if failures:
    sys.exit("FAILED: " + ", ".join(failures))
print("all transformers checks passed")
