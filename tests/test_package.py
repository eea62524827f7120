"""The wheel installs one top-level package, blockspec, whose subpackages are the repository's
top-level folders (pyproject.toml maps them), and it runs from where it is installed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("service", "workers", "verification", "protos", "loadtest", "models")


def _code_only(folder: str, names: list[str]) -> list[str]:
    """copytree's ignore: all but the Python files and folders (models/ holds weights too)."""
    code = [n for n in names if n.endswith(".py") or (Path(folder) / n).is_dir()]
    return [n for n in names if n not in code or n == "__pycache__"]


def test_the_wheel_installs_only_blockspec_and_runs_from_there(tmp_path):
    source = tmp_path / "source"  # a copy: setuptools builds in the source tree (build/)
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    for name in SUBPACKAGES:
        shutil.copytree(ROOT / name, source / name, ignore=_code_only)
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "-w", str(wheels), str(source)], check=True, timeout=300)
    (wheel,) = wheels.glob("blockspec-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"blockspec", wheel.name.split("-py")[0] + ".dist-info"}, tops

    # An empty venv, the wheel its one package; the dependencies come from this environment's
    # site-packages, where blockspec itself is only an editable install's finder (a .pth file,
    # which a PYTHONPATH entry does not run): every blockspec module must load from the venv.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    subprocess.run([*install, str(wheel)], check=True, timeout=300)
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    installed = sorted(p.name for p in site.iterdir() if not p.name.startswith(("_", "__")))
    assert installed[0] == "blockspec" and installed[1].startswith("blockspec-"), installed
    assert len(installed) == 2, installed
    code = textwrap.dedent(
        f"""
        import json, sys
        import blockspec.service.cli, blockspec.service.gateway, blockspec.workers.step
        import blockspec.verification, blockspec.protos.blockspec_pb2_grpc, blockspec.loadtest.cli
        import blockspec.models.prompts
        tops = {{name.split(".")[0] for name in sys.modules}}
        files = {{n: m.__file__ for n, m in sys.modules.items()
                 if n.startswith("blockspec.") and getattr(m, "__file__", None)}}
        print(json.dumps([sorted(tops & set({SUBPACKAGES!r})), files]))
        """
    )
    env = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [python, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    bare, files = json.loads(done.stdout)
    assert bare == [], f"modules imported by their folder's name: {bare}"
    assert files and all(f.startswith(str(site / "blockspec")) for f in files.values()), files
    cli = subprocess.run(
        [venv / "bin" / "blockspec", "--help"], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert cli.returncode == 0 and "serve" in cli.stdout, cli.stderr
    bench = subprocess.run(
        [venv / "bin" / "blockspec-bench", "--help"], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert bench.returncode == 0 and "gpu-shaped" in bench.stdout, bench.stderr
