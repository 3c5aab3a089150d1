"""NeuroLLM reference model in PyTorch, written from DESIGN.md sections 2 and 6
only (section 6: the model variants: encoders, GeGLU, dense FFN, local
attention windows, YaRN, packed rows, ignored targets).

It is the independent yardstick the C runtime is tested against: the golden
vectors (gen_golden.py), their self-check (check_golden.py) and the speed
baseline (bench/torch_baseline.py) all use it. Three parts:

  * a small safetensors reader/writer (F32, F64, I32, I64; 0-dim scalars;
    string-valued __metadata__), no third-party package needed;
  * the model: NeuroLLM, an nn.Module whose state_dict() names are exactly
    the checkpoint names of DESIGN section 2, with sparse expert dispatch and
    an optional KV cache for decoding; loss() returns (loss, ce, aux);
  * checkpoint load/save with __metadata__ {format, config, step}.

Needs only torch, numpy and the standard library (Debian python3-torch).
"""

import json
import math
import struct

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------- config --

CONFIG_KEYS = ("vocab_size", "vocab_chunk", "hidden_dim", "num_layers",
               "num_heads", "num_kv_heads", "ffn_dim", "num_experts", "top_k",
               "max_seq_len", "rope_base", "norm_eps", "aux_loss_coef")
# DESIGN section 6: optional keys, written to a checkpoint only when they
# differ from these defaults (so a section 2 config reads as it always did)
VARIANT_DEFAULTS = {"causal": True, "ffn_act": "swiglu",
                    "attention_window": 0, "global_every": 1,
                    "rope_scaling": None, "objective": "clm",
                    "mask_prob": 0.3, "num_classes": 0}
INT_KEYS = ("vocab_size", "vocab_chunk", "hidden_dim", "num_layers",
            "num_heads", "num_kv_heads", "ffn_dim", "num_experts", "top_k",
            "max_seq_len")


def make_config(**kw):
    """A complete config dict: given keys plus the DESIGN section 2 defaults.

    vocab_size, hidden_dim and num_layers have no default and must be given.
    """
    unknown = set(kw) - set(CONFIG_KEYS) - set(VARIANT_DEFAULTS)
    if unknown:
        raise ValueError("unknown config keys: %s" % sorted(unknown))
    for key in ("vocab_size", "hidden_dim", "num_layers"):
        if key not in kw:
            raise ValueError("config key %s has no default" % key)
    d = int(kw["hidden_dim"])
    cfg = {"vocab_size": int(kw["vocab_size"]),
           "vocab_chunk": int(kw.get("vocab_chunk", 32768)),
           "hidden_dim": d,
           "num_layers": int(kw["num_layers"])}
    cfg["num_heads"] = int(kw.get("num_heads", d // 64))
    cfg["num_kv_heads"] = int(kw.get("num_kv_heads",
                                     max(1, cfg["num_heads"] // 4)))
    cfg["ffn_dim"] = int(kw.get("ffn_dim", 4 * d))
    cfg["num_experts"] = int(kw.get("num_experts", 8))
    cfg["top_k"] = int(kw.get("top_k", 2))
    cfg["max_seq_len"] = int(kw.get("max_seq_len", 2048))
    cfg["rope_base"] = float(kw.get("rope_base", 10000.0))
    cfg["norm_eps"] = float(kw.get("norm_eps", 1e-6))
    cfg["aux_loss_coef"] = float(kw.get("aux_loss_coef", 0.01))
    for key, default in VARIANT_DEFAULTS.items():
        cfg[key] = kw.get(key, default)
    if cfg["rope_scaling"] is not None:
        rs = dict(cfg["rope_scaling"])
        rs.setdefault("beta_fast", 32.0)
        rs.setdefault("beta_slow", 1.0)
        cfg["rope_scaling"] = rs
    check_config(cfg)
    return cfg


def check_config(cfg):
    """Raise ValueError when the config breaks a DESIGN section 2 rule."""
    for key in CONFIG_KEYS:
        if key not in cfg:
            raise ValueError("config lacks key %s" % key)
    for key in INT_KEYS:
        if int(cfg[key]) != cfg[key] or cfg[key] < 1:
            raise ValueError("config %s must be a positive integer" % key)
    d, h, g = cfg["hidden_dim"], cfg["num_heads"], cfg["num_kv_heads"]
    if d % h or (d // h) % 2:
        raise ValueError("hidden_dim %d / num_heads %d must be an even "
                         "head_dim" % (d, h))
    if h % g:
        raise ValueError("num_heads %d not divisible by num_kv_heads %d" %
                         (h, g))
    if cfg["top_k"] > cfg["num_experts"]:
        raise ValueError("top_k %d > num_experts %d" %
                         (cfg["top_k"], cfg["num_experts"]))
    if cfg["rope_base"] <= 0 or cfg["norm_eps"] <= 0:
        raise ValueError("rope_base and norm_eps must be positive")
    if cfg.get("ffn_act", "swiglu") not in ("swiglu", "geglu"):
        raise ValueError("ffn_act must be swiglu or geglu")
    if cfg["num_experts"] == 1 and cfg["top_k"] != 1:
        raise ValueError("a dense FFN (num_experts 1) has top_k 1")
    rs = cfg.get("rope_scaling")
    if rs is not None and rs.get("type") != "yarn":
        raise ValueError("rope_scaling type must be yarn")


def config_json(cfg):
    """The config as stored in a checkpoint: every section 2 key, and the
    section 6 keys that differ from their defaults."""
    out = {k: cfg[k] for k in CONFIG_KEYS}
    for key, default in VARIANT_DEFAULTS.items():
        if cfg.get(key, default) != default:
            out[key] = cfg[key]
    return out


def dense(cfg):
    """DESIGN 6: num_experts 1 is a dense FFN without a router."""
    return cfg["num_experts"] == 1


def layer_window(cfg, l):
    """The attention window of layer l (0: global)."""
    w, n = cfg.get("attention_window", 0), cfg.get("global_every", 1)
    return w if w > 0 and (n == 0 or l % n != 0) else 0


def capacity_rows(cfg):
    """C = ceil(vocab_size / vocab_chunk) * vocab_chunk."""
    chunk = cfg["vocab_chunk"]
    return -(-cfg["vocab_size"] // chunk) * chunk


def weight_shapes(cfg):
    """Checkpoint name -> shape for every weight, in DESIGN order."""
    d, L = cfg["hidden_dim"], cfg["num_layers"]
    h, g = cfg["num_heads"], cfg["num_kv_heads"]
    hd = d // h
    f, e_n, c = cfg["ffn_dim"], cfg["num_experts"], capacity_rows(cfg)
    shapes = {"tok_embeddings.weight": (c, d)}
    for l in range(L):
        p = "layers.%d." % l
        shapes[p + "attention_norm.weight"] = (d,)
        shapes[p + "attention.wq.weight"] = (h * hd, d)
        shapes[p + "attention.wk.weight"] = (g * hd, d)
        shapes[p + "attention.wv.weight"] = (g * hd, d)
        shapes[p + "attention.wo.weight"] = (d, h * hd)
        shapes[p + "ffn_norm.weight"] = (d,)
        if not dense(cfg):
            shapes[p + "moe.router.weight"] = (e_n, d)
        for e in range(e_n):
            q = p + "moe.experts.%d." % e
            shapes[q + "w_gate.weight"] = (f, d)
            shapes[q + "w_up.weight"] = (f, d)
            shapes[q + "w_down.weight"] = (d, f)
    shapes["norm.weight"] = (d,)
    shapes["lm_head.weight"] = (c, d)
    if cfg.get("num_classes", 0) > 0:
        shapes["classifier.weight"] = (cfg["num_classes"], d)
    return shapes


def init_weights(cfg, generator=None, dtype=torch.float32):
    """DESIGN initialisation: normal(0, 0.02) matrices, wo and w_down scaled
    by 1/sqrt(2L), norm weights 1."""
    out = {}
    out_scale = 1.0 / math.sqrt(2.0 * cfg["num_layers"])
    for name, shape in weight_shapes(cfg).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape, dtype=dtype)
            continue
        std = 0.02
        if name.endswith("wo.weight") or name.endswith("w_down.weight"):
            std *= out_scale
        out[name] = torch.randn(shape, generator=generator, dtype=dtype) * std
    return out


# ----------------------------------------------------------- safetensors --

_DTYPES = {  # safetensors name -> (numpy little-endian dtype, torch dtype)
    "F32": ("<f4", torch.float32),
    "F64": ("<f8", torch.float64),
    "I32": ("<i4", torch.int32),
    "I64": ("<i8", torch.int64),
}
_TORCH_TO_ST = {v[1]: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 << 20


def save_safetensors(path, tensors, metadata=None):
    """Write {name: tensor} (F32/F64/I32/I64, any rank incl. 0) to path.

    metadata values must be strings. Tensors are laid out by element size
    (largest first), then name, and the header is padded with spaces so the
    data starts 8-byte aligned: every tensor is aligned to its element size.
    """
    header, blobs, offset = {}, [], 0
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError("__metadata__ keys and values must be str")
        header["__metadata__"] = dict(metadata)
    for name in sorted(tensors, key=lambda n: (-tensors[n].element_size(),
                                               n)):
        t = tensors[name]
        if name == "__metadata__":
            raise ValueError("tensor may not be named __metadata__")
        if t.dtype not in _TORCH_TO_ST:
            raise TypeError("%s: unsupported dtype %s" % (name, t.dtype))
        st = _TORCH_TO_ST[t.dtype]
        data = (t.detach().cpu().contiguous().numpy()
                .astype(_DTYPES[st][0], copy=False).tobytes())
        header[name] = {"dtype": st, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * ((-(8 + len(hbytes))) % 8)
    with open(path, "wb") as fp:
        fp.write(struct.pack("<Q", len(hbytes)))
        fp.write(hbytes)
        for data in blobs:
            fp.write(data)


def load_safetensors(path):
    """Read path; return ({name: tensor}, metadata dict). Validates the
    header, dtypes, shapes and that offsets tile the data section exactly."""
    with open(path, "rb") as fp:
        raw = fp.read()
    if len(raw) < 8:
        raise ValueError("%s: shorter than the 8-byte header length" % path)
    (hlen,) = struct.unpack("<Q", raw[:8])
    if hlen > _MAX_HEADER or 8 + hlen > len(raw):
        raise ValueError("%s: header length %d out of range" % (path, hlen))
    header = json.loads(raw[8:8 + hlen].decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("%s: header is not a JSON object" % path)
    data = memoryview(raw)[8 + hlen:]
    metadata = header.pop("__metadata__", None) or {}
    if not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("%s: __metadata__ values must be strings" % path)
    spans, tensors = [], {}
    for name, info in header.items():
        st = info.get("dtype")
        if st not in _DTYPES:
            raise ValueError("%s: %s has unsupported dtype %r" %
                             (path, name, st))
        shape = info.get("shape")
        begin, end = info.get("data_offsets", (None, None))
        if (not isinstance(shape, list)
                or not all(isinstance(s, int) and s >= 0 for s in shape)
                or not isinstance(begin, int) or not isinstance(end, int)
                or not 0 <= begin <= end <= len(data)):
            raise ValueError("%s: %s has a bad shape or offsets" %
                             (path, name))
        npdt, tdt = _DTYPES[st]
        numel = math.prod(shape)
        if end - begin != numel * np.dtype(npdt).itemsize:
            raise ValueError("%s: %s byte size %d does not match shape %s" %
                             (path, name, end - begin, shape))
        arr = np.frombuffer(data[begin:end], dtype=npdt, count=numel)
        tensors[name] = torch.from_numpy(
            arr.astype(npdt[1:], copy=True)).reshape(shape).to(tdt)
        spans.append((begin, end))
    spans.sort()
    pos = 0
    for begin, end in spans:
        if begin != pos:
            raise ValueError("%s: tensor data overlaps or leaves a hole at "
                             "byte %d" % (path, pos))
        pos = end
    if pos != len(data):
        raise ValueError("%s: %d trailing bytes after the tensors" %
                         (path, len(data) - pos))
    return tensors, metadata


def save_checkpoint(path, cfg, weights, step=0):
    """Write a neurollm/1 checkpoint: the weights (as F32) and metadata."""
    check_config(cfg)
    shapes = weight_shapes(cfg)
    if set(weights) != set(shapes):
        raise ValueError("weights do not match config: missing %s, extra %s" %
                         (sorted(set(shapes) - set(weights))[:3],
                          sorted(set(weights) - set(shapes))[:3]))
    out = {k: v.detach().to(torch.float32) for k, v in weights.items()}
    meta = {"format": "neurollm/1",
            "config": json.dumps(config_json(cfg)),
            "step": str(int(step))}
    save_safetensors(path, out, meta)


def load_checkpoint(path):
    """Read a neurollm/1 checkpoint; return (cfg, weights, step)."""
    tensors, meta = load_safetensors(path)
    if meta.get("format") != "neurollm/1":
        raise ValueError("%s: format %r is not neurollm/1" %
                         (path, meta.get("format")))
    cfg = make_config(**json.loads(meta["config"]))
    for name, shape in weight_shapes(cfg).items():
        if name not in tensors:
            raise ValueError("%s: missing tensor %s" % (path, name))
        if tuple(tensors[name].shape) != shape:
            raise ValueError("%s: %s has shape %s, config wants %s" %
                             (path, name, tuple(tensors[name].shape), shape))
    return cfg, tensors, int(meta.get("step", "0"))


# ----------------------------------------------------------------- model --


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) \
            * self.weight


def rope_freqs(head_dim, base, scaling=None):
    """theta_i = base^(-2i/hd) in float64, and the cos/sin factor; with
    rope_scaling YaRN (DESIGN 6): r_i = L0 theta_i / (2 pi), gamma_i =
    clamp((r_i - beta_slow) / (beta_fast - beta_slow), 0, 1), theta'_i =
    (1 - gamma_i) theta_i / s + gamma_i theta_i, factor m = 0.1 ln s + 1."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    inv = torch.pow(torch.tensor(float(base), dtype=torch.float64),
                    -2.0 * i / head_dim)
    if scaling is None:
        return inv, 1.0
    s, l0 = float(scaling["factor"]), scaling["original_max_seq_len"]
    fast, slow = float(scaling["beta_fast"]), float(scaling["beta_slow"])
    r = l0 * inv / (2 * math.pi)
    gamma = ((r - slow) / (fast - slow)).clamp(0.0, 1.0)
    return (1 - gamma) * inv / s + gamma * inv, 0.1 * math.log(s) + 1.0


def rope_tables(pos0, t, head_dim, base, dtype, scaling=None, pos=None):
    """cos, sin [t, head_dim/2] for positions pos0..pos0+t-1 (or, given a
    position tensor pos, pos.shape + [head_dim/2]).

    Angle pos * theta_i is computed in float64, and cos/sin (times YaRN's
    factor) are rounded to float32 (what the C runtime does) before any
    use, also in double runs.
    """
    inv, m = rope_freqs(head_dim, base, scaling)
    if pos is None:
        pos = torch.arange(pos0, pos0 + t, dtype=torch.float64)
    ang = pos.to(torch.float64)[..., None] * inv
    return ((torch.cos(ang) * m).to(torch.float32).to(dtype),
            (torch.sin(ang) * m).to(torch.float32).to(dtype))


def apply_rope(x, cos, sin):
    """Rotate pairs (2i, 2i+1) of x [B, T, heads, hd] by cos/sin [T, hd/2]
    (or [B, T, hd/2]: per-row positions)."""
    xp = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    x0, x1 = xp[..., 0], xp[..., 1]
    if cos.dim() == 2:
        c, s = cos[None, :, None, :], sin[None, :, None, :]
    else:
        c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).reshape(x.shape)


class Attention(nn.Module):
    def __init__(self, cfg, window=0):
        super().__init__()
        d = cfg["hidden_dim"]
        self.h, self.g = cfg["num_heads"], cfg["num_kv_heads"]
        self.hd = d // self.h
        self.base = cfg["rope_base"]
        self.scaling = cfg.get("rope_scaling")
        self.causal = cfg.get("causal", True)
        self.window = window
        self.wq = nn.Linear(d, self.h * self.hd, bias=False)
        self.wk = nn.Linear(d, self.g * self.hd, bias=False)
        self.wv = nn.Linear(d, self.g * self.hd, bias=False)
        self.wo = nn.Linear(self.h * self.hd, d, bias=False)
        self._rope = None  # (cos, sin) for positions 0..n-1

    def rope(self, pos0, t, dtype):
        """cos, sin for positions pos0..pos0+t-1, from a cached table."""
        tab = self._rope
        if tab is None or tab[0].dtype != dtype or tab[0].shape[0] < pos0 + t:
            n = max(pos0 + t, 2 * (0 if tab is None else tab[0].shape[0]), 64)
            tab = self._rope = rope_tables(0, n, self.hd, self.base, dtype,
                                           self.scaling)
        return tab[0][pos0:pos0 + t], tab[1][pos0:pos0 + t]

    def mask(self, pos0, t, n_keys, doc=None):
        """True where query t (absolute position pos0 + t) sees key j:
        causal j <= i, or every key (an encoder); a window W keeps causal
        j in (i - W, i], bidirectional abs(i - j) <= W / 2; packed rows
        (doc [B, T] ids) keep a query inside its document. [T, S] or
        [B, 1, T, S]."""
        qpos = torch.arange(pos0, pos0 + t)[:, None]
        kpos = torch.arange(n_keys)[None, :]
        ok = kpos <= qpos if self.causal else torch.ones(t, n_keys,
                                                         dtype=torch.bool)
        if self.window > 0:
            if self.causal:
                ok = ok & (kpos > qpos - self.window)
            else:
                ok = ok & ((kpos - qpos).abs() <= self.window // 2)
        if doc is not None:
            same = doc[:, :, None] == doc[:, None, :]  # [B, T, T]
            ok = (ok[None] & same)[:, None]
        return ok

    def forward(self, a, cache=None, pos=None, doc=None):
        """a [B, T, d]; cache: None or a dict {'k','v'} of [B, S, G, hd]
        (rotated keys) that is extended in place; pos [B, T]: positions of
        packed rows and doc [B, T] their documents (no cache). Returns
        [B, T, d]."""
        b, t, _ = a.shape
        pos0 = 0 if cache is None or cache.get("k") is None \
            else cache["k"].shape[1]
        q = self.wq(a).view(b, t, self.h, self.hd)
        k = self.wk(a).view(b, t, self.g, self.hd)
        v = self.wv(a).view(b, t, self.g, self.hd)
        if pos is not None:
            cos, sin = rope_tables(0, t, self.hd, self.base, a.dtype,
                                   self.scaling, pos)
        else:
            cos, sin = self.rope(pos0, t, a.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            if pos0:
                k = torch.cat((cache["k"], k), 1)
                v = torch.cat((cache["v"], v), 1)
            cache["k"], cache["v"] = k, v
        rep = self.h // self.g  # query head h reads kv head h // rep
        kh = k.repeat_interleave(rep, 2).transpose(1, 2)  # [B, H, S, hd]
        vh = v.repeat_interleave(rep, 2).transpose(1, 2)
        qh = q.transpose(1, 2)  # [B, H, T, hd]
        s = torch.matmul(qh, kh.transpose(-1, -2)) / math.sqrt(self.hd)
        s = s.masked_fill(~self.mask(pos0, t, kh.shape[2], doc), float("-inf"))
        o = torch.matmul(torch.softmax(s, -1), vh)  # [B, H, T, hd]
        return self.wo(o.transpose(1, 2).reshape(b, t, self.h * self.hd))


class Expert(nn.Module):
    """W_down(act(W_gate f) * (W_up f)): act silu (SwiGLU) or the exact erf
    GELU (GeGLU, DESIGN 6)."""

    def __init__(self, d, f, act="swiglu"):
        super().__init__()
        self.w_gate = nn.Linear(d, f, bias=False)
        self.w_up = nn.Linear(d, f, bias=False)
        self.w_down = nn.Linear(f, d, bias=False)
        self.act = F.silu if act == "swiglu" else F.gelu

    def forward(self, x):
        return self.w_down(self.act(self.w_gate(x)) * self.w_up(x))


def route(probs, k):
    """Top-k of probs [N, E] with ties to the lower expert index.

    Returns (indices [N, k], renormalised weights [N, k]); the weights are
    differentiable through probs.
    """
    # A stable sort of -p keeps equal probabilities in index order.
    _, order = torch.sort(-probs.detach(), dim=-1, stable=True)
    idx = order[:, :k]
    sel = probs.gather(1, idx)
    return idx, sel / sel.sum(-1, keepdim=True)


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["hidden_dim"]
        self.n_exp, self.k = cfg["num_experts"], cfg["top_k"]
        if not dense(cfg):
            self.router = nn.Linear(d, self.n_exp, bias=False)
        act = cfg.get("ffn_act", "swiglu")
        self.experts = nn.ModuleList(
            Expert(d, cfg["ffn_dim"], act) for _ in range(self.n_exp))

    def forward(self, f):
        """f [B, T, d] -> (moe output [B, T, d], aux scalar)."""
        if self.n_exp == 1:  # dense FFN: no router, no aux loss
            return self.experts[0](f), f.new_zeros(())
        shape = f.shape
        x = f.reshape(-1, shape[-1])
        n = x.shape[0]
        probs = torch.softmax(self.router(x), -1)  # [N, E]
        idx, w = route(probs, self.k)
        # Sparse dispatch: group the N*k (token, slot) assignments by expert.
        flat = idx.reshape(-1)
        _, order = torch.sort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_exp)
        tok = order // self.k
        wsel = w.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, cnt in enumerate(counts.tolist()):
            if cnt:
                rows = tok[start:start + cnt]
                y = self.experts[e](x[rows]) * wsel[start:start + cnt, None]
                out.index_add_(0, rows, y)
            start += cnt
        frac = counts.to(x.dtype) / float(n * self.k)  # not differentiable
        aux = self.n_exp * (frac * probs.mean(0)).sum()
        return out.reshape(shape), aux


class Block(nn.Module):
    def __init__(self, cfg, window=0):
        super().__init__()
        d, eps = cfg["hidden_dim"], cfg["norm_eps"]
        self.attention_norm = RMSNorm(d, eps)
        self.attention = Attention(cfg, window)
        self.ffn_norm = RMSNorm(d, eps)
        self.moe = MoE(cfg)

    def forward(self, x, cache=None, pos=None, doc=None):
        h1 = x + self.attention(self.attention_norm(x), cache, pos, doc)
        y, aux = self.moe(self.ffn_norm(h1))
        return h1 + y, aux


class Embedding(nn.Module):
    """tok_embeddings: a [C, d] table indexed by token id."""

    def __init__(self, rows, d):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, d))

    def forward(self, tokens):
        return self.weight[tokens]


class Head(nn.Module):
    """lm_head: a [C, d] table of which only rows [:vocab_size] are used."""

    def __init__(self, rows, d, vocab):
        super().__init__()
        self.vocab = vocab
        self.weight = nn.Parameter(torch.empty(rows, d))

    def forward(self, x):
        return F.linear(x, self.weight[:self.vocab])


class NeuroLLM(nn.Module):
    """The DESIGN section 2 model; state_dict() uses the checkpoint names."""

    def __init__(self, cfg, weights=None):
        super().__init__()
        check_config(cfg)
        self.cfg = dict(cfg)
        c, d = capacity_rows(cfg), cfg["hidden_dim"]
        self.tok_embeddings = Embedding(c, d)
        self.layers = nn.ModuleList(Block(cfg, layer_window(cfg, l))
                                    for l in range(cfg["num_layers"]))
        self.norm = RMSNorm(d, cfg["norm_eps"])
        self.lm_head = Head(c, d, cfg["vocab_size"])
        if cfg.get("num_classes", 0) > 0:  # DESIGN 6: on mean-pooled states
            self.classifier = nn.Linear(d, cfg["num_classes"], bias=False)
        if weights is None:
            weights = init_weights(cfg)
        self.load_weights(weights)

    def load_weights(self, weights):
        """Copy {checkpoint name: tensor}; names and shapes must match."""
        own = dict(self.named_parameters())
        if set(own) != set(weights):
            raise ValueError("weight names differ: missing %s, extra %s" %
                             (sorted(set(own) - set(weights))[:3],
                              sorted(set(weights) - set(own))[:3]))
        with torch.no_grad():
            for name, p in own.items():
                if p.shape != weights[name].shape:
                    raise ValueError("%s: shape %s, want %s" %
                                     (name, tuple(weights[name].shape),
                                      tuple(p.shape)))
                p.copy_(weights[name])

    def hidden(self, tokens, caches=None, doc=None):
        """The final-normed states [B, T, d] and the sum of aux_l; doc
        [B, T]: packed rows (positions restart at 0 for each document)."""
        pos = None if doc is None else doc_positions(doc)
        x = self.tok_embeddings(tokens)
        aux = x.new_zeros(())
        for l, layer in enumerate(self.layers):
            x, a = layer(x, None if caches is None else caches[l], pos, doc)
            aux = aux + a
        return self.norm(x), aux

    def forward(self, tokens, caches=None, doc=None):
        """tokens [B, T] int64 -> (logits [B, T, vocab_size], sum of aux_l).

        caches: None (positions start at 0), or a list with one dict per
        layer (start with [{} for each layer]) that is extended in place;
        positions then start at the cache length. doc: see hidden().
        """
        h, aux = self.hidden(tokens, caches, doc)
        return self.lm_head(h), aux


class LoRA(nn.Module):
    """DESIGN 6 LoRA around a frozen linear map: y = x W^T + (alpha / r)
    (x A^T) B^T. Parameter names: <map>.lora_A.weight, <map>.lora_B.weight
    (and the base under <map>.base.weight)."""

    def __init__(self, base, rank, alpha):
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.scale * self.lora_B(self.lora_A(x))


EXPERT_TARGETS = ("w_gate", "w_up", "w_down")


def lora_sites(model, targets):
    """(adapter name prefix, owning module, attribute) of every map the
    targets name: wq/wk/wv/wo of each layer's attention, and w_gate/w_up/
    w_down of each expert (each expert its own adapter)."""
    for l, layer in enumerate(model.layers):
        for t in targets:
            if t in EXPERT_TARGETS:
                for e, ex in enumerate(layer.moe.experts):
                    yield "layers.%d.moe.experts.%d.%s." % (l, e, t), ex, t
            else:
                yield "layers.%d.attention.%s." % (l, t), layer.attention, t


def add_lora(model, rank, alpha, targets, adapters):
    """Wrap the targets (e.g. ("wq", "wo", "w_up")) of every layer in LoRA
    with the given {name: tensor} adapters; freeze everything else."""
    for p in model.parameters():
        p.requires_grad_(False)
    dtype = model.layers[0].attention_norm.weight.dtype
    for name, owner, t in list(lora_sites(model, targets)):
        lo = LoRA(getattr(owner, t), rank, alpha).to(dtype)
        with torch.no_grad():
            lo.lora_A.weight.copy_(adapters[name + "lora_A.weight"])
            lo.lora_B.weight.copy_(adapters[name + "lora_B.weight"])
        setattr(owner, t, lo)
    return model


def classify(model, tokens, lengths, doc=None):
    """(class logits [B, K], sum of aux_l): the classifier on the mean over
    each sequence's first lengths[b] final-normed states (DESIGN 6)."""
    h, aux = model.hidden(tokens, doc=doc)
    t = tokens.shape[1]
    valid = (torch.arange(t)[None, :] < lengths[:, None]).to(h.dtype)
    pooled = (h * valid[..., None]).sum(1) / lengths[:, None].to(h.dtype)
    return model.classifier(pooled), aux


def classify_loss(model, tokens, lengths, labels, doc=None):
    """(loss, mean cross-entropy over the B labels, aux)."""
    logits, aux = classify(model, tokens, lengths, doc)
    ce = F.cross_entropy(logits, labels)
    return ce + model.cfg["aux_loss_coef"] * aux, ce, aux


def doc_positions(doc):
    """Positions [B, T] that restart at 0 where the document id changes."""
    b, t = doc.shape
    pos = torch.zeros(b, t, dtype=torch.int64)
    for i in range(1, t):
        pos[:, i] = torch.where(doc[:, i] == doc[:, i - 1], pos[:, i - 1] + 1,
                                torch.zeros_like(pos[:, i]))
    return pos


def loss_fn(logits, aux, targets, cfg):
    """(loss, mean cross-entropy, summed aux); loss = ce + coef * aux.
    Targets below 0 are ignored: the mean is over the others (DESIGN 6)."""
    flat, tgt = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    keep = tgt >= 0
    ce = F.cross_entropy(flat[keep], tgt[keep])
    return ce + cfg["aux_loss_coef"] * aux, ce, aux


def forward_loss(model, tokens, targets, doc=None):
    """Run the model and return (loss, ce, aux, logits)."""
    logits, aux = model(tokens, doc=doc)
    loss, ce, aux = loss_fn(logits, aux, targets, model.cfg)
    return loss, ce, aux, logits


def router_margins(model, tokens, doc=None):
    """Per layer, the smallest gap between the k-th and (k+1)-th router logit
    over all tokens (infinite when top_k == num_experts or the FFN is
    dense). Small gaps make the routing fragile under rounding;
    gen_golden.py rejects such seeds."""
    gaps = []
    pos = None if doc is None else doc_positions(doc)
    with torch.no_grad():
        x = model.tok_embeddings(tokens)
        for layer in model.layers:
            h1 = x + layer.attention(layer.attention_norm(x), None, pos, doc)
            f = layer.ffn_norm(h1)
            k = layer.moe.k
            if k < layer.moe.n_exp:
                logits = layer.moe.router(f).reshape(-1, layer.moe.n_exp)
                top, _ = torch.sort(logits, -1, descending=True)
                gaps.append(float((top[:, k - 1] - top[:, k]).min()))
            else:
                gaps.append(float("inf"))
            y, _ = layer.moe(f)
            x = h1 + y
    return gaps
