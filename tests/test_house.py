"""The shape of the house: what a newcomer can rely on without reading everything.

- The repository stands alone: nothing in it reads outside it (its tests' reference data and
  its documentation live in it).
- The packages form no cycle, and the verification library (pure math on tensors) imports
  nothing of the service or the workers: both of them import it.
- No function is over 80 lines outside scripts/ and the compiled kernel modules (whose loops
  are long because the math is sequential and every call is a launch).
- Under scripts/test.sh's ``--dist loadgroup`` the Ray tests share one worker.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "workers", "verification", "loadtest", "protos", "models")
LONGEST_FUNCTION = 80


def tracked(suffix: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", f"*{suffix}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / name for name in out if (ROOT / name).is_file()]


def python_files() -> list[Path]:
    return [p for p in tracked(".py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def package_imports() -> dict[str, set[str]]:
    """package -> the other top-level packages its modules import (at any depth)."""
    graph: dict[str, set[str]] = {name: set() for name in PACKAGES}
    for path in python_files():
        package = path.relative_to(ROOT).parts[0]
        if package not in graph:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            tops = {n.split(".")[1] for n in names if n.startswith("blockspec.")}
            graph[package] |= tops & set(PACKAGES) - {package}
    return graph


def test_nothing_reads_outside_the_repository():
    # The sibling folder the project's early tests read its reference data from, spelled
    # without writing its path here (this file is searched too).
    sibling = "/".join(["..", "shared"])
    outside = (sibling, sibling[3:] + "/spec", sibling[3:] + "/seeds")
    hits = [
        f"{path.relative_to(ROOT)}: {text!r}"
        for path in tracked("")
        if path.suffix in {".py", ".sh", ".toml", ".md", ".yaml", ".yml", ".cfg"}
        for text in outside
        if text in path.read_text(errors="replace")
    ]
    assert not hits, "the repository must stand alone:\n" + "\n".join(hits)
    assert (ROOT / "tests" / "reference" / "reference_instances.json").is_file()
    assert (ROOT / "docs" / "verification.md").is_file()


def test_the_packages_form_no_cycle():
    graph = package_imports()

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(
            nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
            for nxt in graph[start]
        )

    cycles = [name for name in graph if reaches(name, name)]
    assert not cycles, f"package import cycle through {cycles}: {graph}"


def test_the_verification_library_imports_neither_the_service_nor_the_workers():
    graph = package_imports()
    assert not graph["verification"] & {"service", "workers", "loadtest"}, graph
    assert "verification" in graph["service"] and "verification" in graph["workers"], graph


def test_no_function_is_over_80_lines_outside_scripts_and_kernels():
    long = []
    for path in python_files():
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "scripts" or "kernels" in path.stem:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(long)


def test_no_test_loads_code_by_its_file_path():
    """Tests import the package's modules (blockspec.*), never a file by its path: what they
    test is what installs."""
    loaders = ("spec_from_file_location", "runpy.run_path", "SourceFileLoader")
    found = [
        f"{path.name}: {loader}"
        for path in sorted((ROOT / "tests").glob("*.py"))
        if path.name != Path(__file__).name
        for loader in loaders
        if loader in path.read_text()
    ]
    assert not found, found


@pytest.mark.xdist_group("ray")
def test_the_ray_tests_share_one_worker(request):
    """The tests marked ``xdist_group("ray")`` run on one worker, so they share one Ray cluster
    and service (tests/live_service.py). pytest-xdist passes a test's group to its scheduler as
    a suffix of the node id; pytest 9.2 with pytest-xdist 3.8 loses the suffix
    (pytest-xdist#1386): the tests then spread over every worker, each starting its own cluster
    on the same cores, and nothing else fails (hence the pytest pin in pyproject.toml)."""
    if not getattr(request.config.option, "loadgroup", False):  # set on xdist's workers
        pytest.skip("runs under pytest -n N --dist loadgroup (scripts/test.sh)")
    assert request.node.nodeid.endswith("@ray"), (
        f"{request.node.nodeid}: pytest-xdist did not group it, so every "
        "worker started its own cluster (see the pytest pin in pyproject.toml)"
    )
