"""What an idle service costs the machine: the CPU its processes use per second (in cores)
while a service on the tiny pair (as the tests run it: embedded session store, gRPC, HTTP and
metrics on) is up and does nothing, at Ray's default metrics report interval (10 s) and at a
shorter one, measured in alternating fresh processes; prints each run and the medians.

CPU time is summed over every process (psutil), not read from /proc/stat: on a VM the latter's
busy time counts the hypervisor's steal, which is noise here.

    blockspec-bench idle --runs 2 --interval-ms 500
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from blockspec.loadtest.bench.harness import (
    alternate,
    cpu_by_process,
    free_port,
    parser,
    spread,
)


def _busy_seconds() -> float:
    return sum(seconds for _, seconds in cpu_by_process().values())


def measure(settle_s: float, window_s: float) -> None:
    """In a fresh process: start the service, let it settle, print the cores it uses idle."""
    from blockspec.service.app import run
    from blockspec.service.config import Settings
    from blockspec.workers.models import TINY_DRAFT, TINY_TARGET

    replica = dict(draft_dir=str(TINY_DRAFT), target_dir=str(TINY_TARGET), max_batch=8,
                   max_queued=2, max_sessions=4)  # fmt: skip
    settings = Settings(
        port=0, http_port=free_port(), metrics_port=free_port(), ray_num_cpus=4, replica=replica
    )
    run(settings, name="idle")
    time.sleep(settle_s)
    before, start = _busy_seconds(), time.monotonic()
    time.sleep(window_s)
    print((_busy_seconds() - before) / (time.monotonic() - start))


def main(argv: list[str] | None = None) -> None:
    ap = parser("idle", __doc__)
    ap.add_argument("--runs", type=int, default=2, help="runs of each interval")
    ap.add_argument("--interval-ms", type=int, default=500, help="the shorter interval")
    ap.add_argument("--settle-s", type=float, default=20.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return measure(args.settle_s, args.window_s)

    def idle_cores(interval: str | None) -> float:
        env = dict(os.environ)
        env.pop("RAY_metrics_report_interval_ms", None)
        if interval is not None:
            env["RAY_metrics_report_interval_ms"] = interval
        child = [sys.executable, "-m", "blockspec.loadtest.bench", "idle", "--child"]
        child += ["--settle-s", str(args.settle_s), "--window-s", str(args.window_s)]
        out = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])

    arms = {
        "10000 (default)": lambda: idle_cores(None),
        str(args.interval_ms): lambda: idle_cores(str(args.interval_ms)),
    }

    def show(label: str, _round: int, cores: float) -> None:
        print(f"interval {label} ms: {cores:.3f} cores", flush=True)

    for label, values in alternate(arms, args.runs, warm=False, on_run=show).items():
        print(f"interval {label} ms: {spread(values, ' cores', 3)}")
