#!/usr/bin/env bash
# Set up (idempotent), lint, and run the default test suite (slow tests excluded).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m slow` for the long statistical runs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -n 2 --dist loadgroup "$@"
