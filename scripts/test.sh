#!/usr/bin/env bash
# Set up what the tests need (idempotent), then run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check rampserve tests
exec .venv/bin/python -m pytest -q "$@"
