#!/usr/bin/env python3
"""Check `neuroctl embed` against nlref (DESIGN section 7 pooling):

    check_embed.py MODEL EMB.safetensors TEXTS SEQ

Each line's bytes (cut to SEQ) through nlref's model: the mean of the
final-normed states, L2-normalised, must equal the row of EMB within 1e-4
(relative). Byte-level models only (no tokenizer). Exits 1 on a mismatch.
"""
import os
import sys

try:
    import torch
except ImportError:  # a python3 without Debian's python3-torch first in PATH
    if os.path.exists("/usr/bin/python3") and os.path.realpath(
            sys.executable) != os.path.realpath("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nlref  # noqa: E402


def main():
    model_path, emb_path, texts, seq = sys.argv[1:5]
    cfg, w, _ = nlref.load_checkpoint(model_path)
    w = {k: v for k, v in w.items() if not k.startswith("optim.")}
    model = nlref.NeuroLLM(cfg, w).double()
    got, _ = nlref.load_safetensors(emb_path)
    got = got["embeddings"].double()
    lines = open(texts, "rb").read().split(b"\n")[:got.shape[0]]
    worst = 0.0
    for i, line in enumerate(lines):
        ids = torch.tensor([list(line[:int(seq)]) or [0]], dtype=torch.int64)
        with torch.no_grad():
            h, _ = model.hidden(ids)
        e = h[0].mean(0)
        e = e / e.norm()
        worst = max(worst, ((got[i] - e).norm() / e.norm()).item())
    print("embed vs nlref: %d rows, worst rel err %.3g" % (len(lines), worst))
    sys.exit(0 if worst < 1e-4 else 1)


if __name__ == "__main__":
    main()
