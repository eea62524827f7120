"""What every benchmark shares: its command line, paths run in turn, medians and ratios, and the
JSON a docs page reads.

A benchmark compares paths (the engine and the service, two weight layouts, two revisions) on
a machine whose speed drifts by more than most differences it measures. So it runs every path
once per round, the order rotating each round so that no path always goes first, after one
discarded warm call of each, and reports medians over rounds with their range; a ratio is the
median of the rounds' ratios, each taken between runs made next to each other.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
Arm = TypeVar("Arm")  # a path's name: a string, or a tuple (layout, configuration, ...)
REPO = Path(__file__).resolve().parents[2]


def parser(name: str, doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """The parser of `blockspec-bench NAME`: its help is the module's docstring."""
    return argparse.ArgumentParser(
        prog=f"blockspec-bench {name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )


def command(name: str, argv: Sequence[str] | None) -> str:
    """The command line that reproduces this run, as docs pages quote it."""
    args = sys.argv[2:] if argv is None else argv
    return " ".join(["blockspec-bench", name, *args])


def alternate(
    arms: Mapping[Arm, Callable[[], T]],
    rounds: int,
    *,
    warm: bool = True,
    on_run: Callable[[Arm, int, T], None] | None = None,
) -> dict[Arm, list[T]]:
    """Each arm once per round, the order rotating by one each round (round r starts with
    arm r mod n); with `warm`, one discarded call of each first. `on_run(arm, round, result)`
    sees every recorded run as it ends."""
    names = list(arms)
    if warm:
        for name in names:
            arms[name]()
    runs: dict[Arm, list[T]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            result = arms[name]()
            runs[name].append(result)
            if on_run is not None:
                on_run(name, r, result)
    return runs


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Round-by-round ratios: each round's runs were made next to each other."""
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def spread(values: Sequence[float], unit: str = "", digits: int = 2) -> str:
    """'median (low–high)': '0.88× (0.86–0.92)' for ratios with unit '×'."""
    if not values:
        return "-"
    low, high = min(values), max(values)
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} ({low:.{digits}f}–{high:.{digits}f})"


def median_run(runs: Sequence[dict], key: str) -> dict:
    """The run with the median `key` (its other numbers with it, so they stay consistent)."""
    return sorted(runs, key=lambda r: r[key])[len(runs) // 2]


def median_ms(
    call: Callable[[], object],
    repeats: int,
    *,
    warm: int = 1,
    sync: Callable[[], None] | None = None,
) -> float:
    """The median wall time of `call` in ms over `repeats` calls after `warm` discarded ones;
    `sync` (torch.cuda.synchronize on a GPU) runs before and after each timed call."""
    for _ in range(warm):
        call()
    laps = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        call()
        if sync is not None:
            sync()
        laps.append(time.perf_counter() - start)
    return 1e3 * statistics.median(laps)


def machine() -> dict:
    """What the numbers were measured on: the CPU, its cores, torch, the revision."""
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):  # /proc/cpuinfo names it on Linux
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    try:
        revision = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        revision = None
    return dict(
        cpu=cpu,
        cores=os.cpu_count(),
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        revision=revision,
    )


def save_json(path: str | Path | None, name: str, argv: Sequence[str] | None, result: dict) -> None:
    """Write `result` to `path` (nothing without one) with the command and the machine."""
    if not path:
        return
    out = {**result, "command": command(name, argv), "machine": machine()}
    Path(path).write_text(json.dumps(out, indent=1, default=_plain) + "\n")


def _plain(obj):
    """JSON for what the service reports (its stats are dataclasses)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def free_port() -> int:
    """A loopback port nothing listens on now, for a server that cannot take port 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def package_view(tree: Path) -> Path:
    """A folder where `blockspec` is `tree`'s code: its top-level folders as the installed
    package's subpackages (pyproject.toml maps them so). Put first on sys.path or PYTHONPATH,
    it is found before the editable install, which maps blockspec to this repository."""
    view = tree / "_package_view"
    (view / "blockspec").mkdir(parents=True, exist_ok=True)
    for name in ("service", "workers", "verification", "protos", "loadtest", "models"):
        link = view / "blockspec" / name
        if (tree / name).is_dir() and not link.exists():
            link.symlink_to(tree / name)
    return view


@contextlib.contextmanager
def worktree(revision: str) -> Iterator[Path]:
    """This repository's `revision` checked out in a temporary git worktree, removed after."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), revision],
            check=True, capture_output=True,
        )  # fmt: skip
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)])


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """Every process's CPU seconds so far (user + system), by pid, with its name: a Ray
    worker's title (ray::DraftActor, ray::ServeReplica:app:Gateway, ...) or its command. Read
    from each process (psutil), not from /proc/stat: on a VM that one counts the hypervisor's
    steal as busy."""
    import psutil

    out = {}
    for proc in psutil.process_iter(["cmdline", "name"]):
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            command_line = proc.info["cmdline"] or [proc.info["name"] or "?"]
            out[proc.pid] = (command_line[0][:60], times.user + times.system)
    return out


def cpu_ms_per_step(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], steps: int
) -> dict[str, float]:
    """CPU ms a step by process name between two `cpu_by_process` snapshots (processes alive
    at both), the busiest first."""
    by_name: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        if pid in before:
            by_name[name] = by_name.get(name, 0.0) + seconds - before[pid][1]
    ms = {name: 1e3 * s / max(steps, 1) for name, s in by_name.items()}
    return dict(sorted(ms.items(), key=lambda item: -item[1]))
