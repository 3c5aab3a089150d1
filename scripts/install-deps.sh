#!/usr/bin/env bash
# Install the Debian 12 packages that building, testing and the demo need,
# then the small Python venv (.venv-hf) the Hugging Face test uses.
# Safe to run again: apt-get skips what is already there, the venv is kept
# while its pins match. `install-deps.sh --hf-venv` makes only the venv.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

# transformers with Mixtral that runs on Debian's torch 1.13, over the
# system packages (torch, numpy, requests, yaml), with pinned --no-deps
# installs so that pip never pulls a second torch; and the official openai
# client (tests/test_openai_client.py) with every package it imports,
# pinned too (over Debian's older certifi, idna, distro and
# typing-extensions; wheels for Python 3.11 on manylinux x86_64).
HF_VENV="${NL_HF_VENV:-$ROOT/.venv-hf}"
HF_PINS="transformers==4.38.2 tokenizers==0.15.2 safetensors==0.4.2 huggingface-hub==0.20.3
 tqdm==4.66.2 regex==2023.12.25 filelock==3.13.1 fsspec==2024.2.0 packaging==23.2
 openai==1.57.0 httpx==0.28.1 httpcore==1.0.7 anyio==4.7.0 sniffio==1.3.1 h11==0.14.0
 pydantic==2.10.3 pydantic-core==2.27.1 typing-extensions==4.12.2 annotated-types==0.7.0
 distro==1.9.0 jiter==0.8.2 idna==3.10 certifi==2024.8.30"
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
    "$HF_VENV/bin/python" -c "import transformers, torch, openai; transformers.MixtralForCausalLM" &&
    echo "$HF_PINS" > "$HF_VENV/.pins" &&
    echo "install-deps: $HF_VENV ready (transformers 4.38.2, openai 1.57.0)"
}

# cuDNN's header-only C++ frontend (the graph API behind the CUDA module's
# flash attention, kernels/cuda/cuda_cudnn.cpp), pinned: the headers of the
# nvidia-cudnn-frontend wheel on PyPI (its include/ is the same in every
# wheel; the cp311 manylinux one is named so that any pip fetches the same
# bytes), checked against its sha256 and unpacked into .deps/ (git-ignored),
# where CMake looks (NL_CUDNN). Fetched only where CUDA is built (nvcc
# present); cuDNN's libraries themselves come with the CUDA toolkit.
CUDNN_FE_VERSION=1.32.0
CUDNN_FE_SHA256=c6006556017a4d1c914c52a556c71b1267f2d6a0500f742e7b4edef539878df0
CUDNN_FE_DIR="$ROOT/.deps/cudnn-frontend"
cudnn_frontend() {
  if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "install-deps: no nvcc: the CUDA module is not built, cuDNN frontend not needed"
    return 0
  fi
  if [ -f "$CUDNN_FE_DIR/.version" ] && [ "$(cat "$CUDNN_FE_DIR/.version")" = "$CUDNN_FE_VERSION" ]; then
    echo "install-deps: cuDNN frontend $CUDNN_FE_VERSION present in $CUDNN_FE_DIR"
    return 0
  fi
  local tmp whl
  tmp="$(mktemp -d)"
  python3 -m pip download -q --no-deps --only-binary :all: --platform manylinux_2_28_x86_64 \
    --python-version 3.11 --implementation cp -d "$tmp" "nvidia-cudnn-frontend==$CUDNN_FE_VERSION" &&
    whl="$(ls "$tmp"/nvidia_cudnn_frontend-*.whl)" &&
    echo "$CUDNN_FE_SHA256  $whl" | sha256sum -c --quiet - &&
    rm -rf "$CUDNN_FE_DIR" && mkdir -p "$CUDNN_FE_DIR" &&
    python3 -c "import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('include/')])" "$whl" "$CUDNN_FE_DIR" &&
    [ -f "$CUDNN_FE_DIR/include/cudnn_frontend.h" ] &&
    echo "$CUDNN_FE_VERSION" > "$CUDNN_FE_DIR/.version" &&
    echo "install-deps: cuDNN frontend $CUDNN_FE_VERSION unpacked into $CUDNN_FE_DIR"
  local rc=$?
  rm -rf "$tmp"
  return $rc
}
if [ "${1:-}" = "--hf-venv" ]; then
  hf_venv
  exit 0
fi
if [ "${1:-}" = "--cudnn-frontend" ]; then
  cudnn_frontend
  exit $?
fi

PKGS=(
  build-essential cmake pkg-config clang clang-format libclang-rt-14-dev
  libdnnl-dev libopenblas-dev libzmq3-dev libmsgpack-dev libsodium-dev libyaml-dev libjansson-dev
  libutf8proc-dev
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
# Without the package index the CUDA module builds without cuDNN attention.
cudnn_frontend || echo "install-deps: could not fetch the cuDNN frontend (no package index?); the CUDA module builds without cuDNN attention"
