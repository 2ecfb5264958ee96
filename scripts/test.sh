#!/usr/bin/env bash
# Set up what the tests need (idempotent), then run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check rampserve tests
# A file's tests run in one worker process (they share its fixtures: a server, a prepared model); files run on every
# core, at most four at once (each worker builds the session's small models again). A worker is one core's worth:
# torch's pool of a thread per core in every worker spun against the others' (one draw each: 623 s, 578 s with one)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile "$@"
