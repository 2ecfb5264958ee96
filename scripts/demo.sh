#!/usr/bin/env bash
# Set everything up, then run the demo on the bundled default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/rampserve demo "$@"
