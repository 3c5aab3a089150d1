#!/usr/bin/env bash
# Install the Debian 12 packages that building, testing and the demo need.
# Safe to run again: apt-get skips what is already there.
set -euo pipefail
PKGS=(
  build-essential cmake pkg-config clang libclang-rt-14-dev
  libdnnl-dev libopenblas-dev libzmq3-dev libmsgpack-dev libsodium-dev libyaml-dev libjansson-dev
  libmicrohttpd-dev libjs-chart.js prometheus chromium
  python3 python3-torch python3-numpy
  fortunes iproute2 procps
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
