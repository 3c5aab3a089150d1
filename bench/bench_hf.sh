#!/usr/bin/env bash
# Issue 19 benchmark: Hugging Face conversion time and peak memory against
# the tensor bytes, for a model made by `neuroctl init` (random weights, no
# tokenizer). Runs export --format hf (ours -> HF directory, 5 GB shards)
# then import --hf (back), each under /usr/bin/time -v, and prints JSON:
#   tensor_bytes      bytes of the model's tensors (the checkpoint, less its header)
#   largest_tensor    bytes of the largest tensor (the embedding or head table)
#   seconds, mb_per_s wall time of the conversion and tensor MB (1e6) per second
#   peak_rss_mb       the process's maximum resident set (MiB); reads use pread,
#                     so the page cache is not counted, only buffers
#   rss_over_tensors  peak_rss / tensor_bytes: streaming keeps this well below 1
#                     (a converter that held the model would be >= 1, twice: >= 2)
#   baseline_rss_mb   the same binary printing its help (what is not conversion)
# Model: d = D (default 1024), 8 experts of 2 d, H = d / 64, G = H / 4, a
# 32000-id vocabulary (Mixtral's) in one chunk, and as many layers as bring
# the checkpoint near SIZE_MB (at least one).
#   bench/bench_hf.sh [BUILD_DIR] [SIZE_MB] [D]     defaults: build 1024 1024
# The files go to a temporary directory under $TMPDIR (needs about 4 x SIZE_MB).
set -euo pipefail
B=${1:-build}
SIZE_MB=${2:-1024}
D=${3:-1024}
N=$B/cli/neuroctl
[ -x "$N" ] || { echo "bench_hf: no $N (build first)" >&2; exit 2; }
W=$(mktemp -d "${TMPDIR:-/tmp}/nl_bench_hf.XXXXXX")
trap 'rm -rf "$W"' EXIT
H=$((D / 64 > 0 ? D / 64 : 1))
G=$((H / 4 > 0 ? H / 4 : 1))
F=$((2 * D))
# bytes: tables 2 x 32000 x d; per layer attention d (H + G) hd x 2, 8 experts
# of 3 d F, router 8 d, two norms
TABLES=$((2 * 32000 * D * 4))
LAYER=$(((2 * D * D + 2 * D * G * (D / H) + 24 * D * F + 8 * D + 2 * D) * 4))
L=$(((SIZE_MB * 1000000 - TABLES) / LAYER))
[ "$L" -ge 1 ] || L=1
cat > "$W/cfg.yaml" <<YAML
hidden_dim: $D
num_layers: $L
num_heads: $H
num_kv_heads: $G
ffn_dim: $F
num_experts: 8
vocab_size: 32000
vocab_chunk: 32000
YAML
"$N" init --config "$W/cfg.yaml" --out "$W/model.safetensors" >/dev/null
measure() { # measure NAME COMMAND...: wall seconds and peak RSS (KiB) of one run
  local name=$1
  shift
  /usr/bin/time -v -o "$W/$name.time" "$@" >/dev/null 2>"$W/$name.err" ||
    { cat "$W/$name.err" >&2; exit 1; }
}
measure baseline "$N" --help
measure export "$N" export --format hf --model "$W/model.safetensors" --out "$W/hf"
measure import "$N" import --hf "$W/hf" --out "$W/back.safetensors"
/usr/bin/python3 - "$W" "$D" "$L" <<'PY'
import json, os, re, struct, sys
w, d, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def header(p):
    with open(p, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in h.items() if k != "__metadata__"}
ours = header(w + "/model.safetensors")
def run(name, nbytes):
    t = open(f"{w}/{name}.time").read()
    m = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", t)
    sec = int(m.group(1) or 0) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", t).group(1)) * 1024
    return {"seconds": round(sec, 3), "mb_per_s": round(nbytes / 1e6 / max(sec, 1e-3), 1),
            "peak_rss_mb": round(rss / 2**20, 1), "rss_over_tensors": round(rss / nbytes, 3)}
hf_bytes = sum(sum(header(os.path.join(w, "hf", f)).values())
               for f in os.listdir(w + "/hf") if f.endswith(".safetensors"))
print(json.dumps({"hidden_dim": d, "num_layers": layers, "tensor_bytes": sum(ours.values()),
                  "largest_tensor": max(ours.values()), "hf_tensor_bytes": hf_bytes,
                  "baseline_rss_mb": run("baseline", 1)["peak_rss_mb"],
                  "export": run("export", sum(ours.values())),
                  "import": run("import", hf_bytes)}, indent=1))
PY
