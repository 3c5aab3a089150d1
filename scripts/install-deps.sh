#!/usr/bin/env bash
# Install the Debian 12 packages that building, testing and the demo need,
# then the small Python venv (.venv-hf) the Hugging Face test uses.
# Safe to run again: apt-get skips what is already there, the venv is kept
# while its pins match. `install-deps.sh --hf-venv` makes only the venv.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

# transformers with Mixtral that runs on Debian's torch 1.13, over the
# system packages (torch, numpy, requests, yaml), with pinned --no-deps
# installs so that pip never pulls a second torch.
HF_VENV="${NL_HF_VENV:-$ROOT/.venv-hf}"
HF_PINS="transformers==4.38.2 tokenizers==0.15.2 safetensors==0.4.2 huggingface-hub==0.20.3
 tqdm==4.66.2 regex==2023.12.25 filelock==3.13.1 fsspec==2024.2.0 packaging==23.2"
hf_venv() {
  if [ -f "$HF_VENV/.pins" ] && [ "$(cat "$HF_VENV/.pins")" = "$HF_PINS" ]; then
    echo "install-deps: $HF_VENV present"
    return 0
  fi
  rm -rf "$HF_VENV"
  # Explicit && chain: set -e does not apply inside `hf_venv || ...`.
  # shellcheck disable=SC2086
  /usr/bin/python3 -m venv --system-site-packages "$HF_VENV" &&
    "$HF_VENV/bin/pip" install -q --no-deps $HF_PINS &&
    "$HF_VENV/bin/python" -c "import transformers, torch; transformers.MixtralForCausalLM" &&
    echo "$HF_PINS" > "$HF_VENV/.pins" &&
    echo "install-deps: $HF_VENV ready (transformers 4.38.2)"
}
if [ "${1:-}" = "--hf-venv" ]; then
  hf_venv
  exit 0
fi

PKGS=(
  build-essential cmake pkg-config clang libclang-rt-14-dev
  libdnnl-dev libopenblas-dev libzmq3-dev libmsgpack-dev libsodium-dev libyaml-dev libjansson-dev
  libmicrohttpd-dev libjs-chart.js prometheus chromium
  python3 python3-torch python3-numpy python3-venv python3-requests python3-yaml
  python3-zmq python3-msgpack
  fortunes iproute2 iptables libnetfilter-queue-dev procps time
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages present"
else
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# The venv needs the package index; without it only the HF test skips.
hf_venv || echo "install-deps: could not make $HF_VENV (no package index?); test_hf_transformers will skip"
