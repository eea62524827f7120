"""What an idle test service costs the machine: the CPU its processes use per second (in cores)
while the service of tests/live_service.py (tiny pair, embedded session store) is up and does
nothing, at Ray's default metrics report interval (10 s) and at a shorter one, measured in
alternating fresh processes; prints each run and the medians.

CPU time is summed over every process (psutil), not read from /proc/stat: on a VM the latter's
busy time counts the hypervisor's steal, which is noise here.

    python scripts/bench_idle_cluster.py --runs 2 --interval-ms 500
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def cpu_seconds() -> float:
    total = 0.0
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def measure(settle_s: float, window_s: float) -> None:
    """In a fresh process: start the service, let it settle, print the cores it uses idle."""
    from blockspec.service.app import run
    from blockspec.service.config import Settings
    from tests.live_service import MAX_BATCH, MAX_QUEUED, TINY_PAIR
    from tests.redis_server import free_port

    replica = dict(**TINY_PAIR, max_batch=MAX_BATCH, max_queued=MAX_QUEUED, max_sessions=4)
    settings = Settings(
        port=0, http_port=free_port(), metrics_port=free_port(), ray_num_cpus=4, replica=replica
    )
    run(settings, name="idle")
    time.sleep(settle_s)
    before, start = cpu_seconds(), time.monotonic()
    time.sleep(window_s)
    print((cpu_seconds() - before) / (time.monotonic() - start))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each interval")
    parser.add_argument("--interval-ms", type=int, default=500, help="the shorter interval")
    parser.add_argument("--settle-s", type=float, default=20.0)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return measure(args.settle_s, args.window_s)
    cores: dict[str, list[float]] = {"10000 (default)": [], str(args.interval_ms): []}
    for _ in range(args.runs):
        for label in cores:
            env = dict(os.environ, PYTHONPATH=str(REPO))
            env.pop("RAY_metrics_report_interval_ms", None)
            if not label.endswith("(default)"):
                env["RAY_metrics_report_interval_ms"] = label
            argv = [sys.executable, __file__, "--child", "--settle-s", str(args.settle_s)]
            argv += ["--window-s", str(args.window_s)]
            out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
            cores[label].append(float(out.stdout.strip().splitlines()[-1]))
            print(f"interval {label} ms: {cores[label][-1]:.3f} cores", flush=True)
    for label, values in cores.items():
        print(f"median, interval {label} ms: {statistics.median(values):.3f} cores")


if __name__ == "__main__":
    main()
