"""Layering: `workers/` (running models) never imports `service/` (the request path), and importing
the verification library changes nothing outside it (no Ray variables: only the code that starts
Ray, service/app.py, sets those).

Imports run in a fresh interpreter: this test process has imported everything already.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKERS = sorted(f"blockspec.workers.{p.stem}" for p in (REPO / "workers").glob("*.py"))


def fresh_python(code: str) -> str:
    """stdout of `code` run by a new interpreter in the repository root."""
    argv = [sys.executable, "-c", textwrap.dedent(code)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_importing_the_verification_library_sets_no_ray_variables():
    code = """
        import json, os
        ray_vars = lambda: {k: v for k, v in os.environ.items() if k.startswith("RAY_")}
        before = ray_vars()
        from blockspec import verification
        print(json.dumps([before, ray_vars()]))
    """
    before, after = json.loads(fresh_python(code))
    assert after == before


def test_workers_modules_import_no_service_module():
    code = f"""
        import importlib, json, sys
        for name in {WORKERS!r}:
            importlib.import_module(name)
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("blockspec.service"))))
    """
    assert json.loads(fresh_python(code)) == []


def test_workers_sources_name_no_service_module():
    """Also imports inside functions, which the import test above does not run."""
    found = []
    for path in sorted((REPO / "workers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            found += [f"{path.name}: {n}" for n in names if n.startswith("blockspec.service")]
    assert found == []


def test_the_http_api_reaches_the_core_without_grpc_s_servicer_or_protobuf():
    """The HTTP adapter maps its wire onto the application core (service/core.py) directly:
    no protobuf message, stub or servicer on its path (grpc's status codes are the one
    vocabulary of refusals both adapters map from)."""
    names = set()
    for node in ast.walk(ast.parse((REPO / "service" / "http_api.py").read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module or "")
    assert not {n for n in names if n.startswith(("blockspec.protos", "google.protobuf"))}
    assert "blockspec.service.gateway" not in names and "blockspec.service.core" in names
