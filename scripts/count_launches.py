"""Kernels a decode step launches outside CUDA graphs, counted on the CPU (no GPU needed).

On a GPU a small model's speculative step is bound by launches and the Python around them, not
by its arithmetic (docs/gpu.md: ~10-30 µs a kernel on the H200's host). This runs the engine
on the fake CUDA device of the tests (tests/fake_device.py), which counts every kernel an
operation would launch eagerly, a graph's replay as one, and prints per configuration the
median launches of a steady step with the decode graphs (emulated: the same static buffers
and replays, without capture) and without, and where the launches come from.

    .venv/bin/python scripts/count_launches.py                 # the tiny pair
    .venv/bin/python scripts/count_launches.py --pair default  # SmolLM2 and its feature draft
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fake_device import FakeCuda  # noqa: E402

from blockspec.service.build import build_engine  # noqa: E402
from blockspec.service.requests import make_request  # noqa: E402
from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET, TINY_DRAFT, TINY_TARGET  # noqa: E402
from blockspec.workers.sampling import SamplingParams  # noqa: E402

CONFIGS = [  # method, K, γ
    ("none", 1, 1),
    ("token", 1, 4),
    ("block", 1, 4),
    ("gbv", 2, 4),
    ("traversal", 2, 4),
    ("spectr", 4, 4),
    ("greedy_block", 1, 4),
    ("spectr_gbv", 2, 4),
]


def launches(engine, method: str, k: int, gamma: int, batch: int, steps: int, warm: int):
    """(median launches of the steps after `warm`, their kernels by site)."""
    limits = engine.limits
    reqs = [
        make_request(
            limits,
            [1 + i, 2, 3, 4],
            (warm + steps) * (gamma + 1) + 8,
            method,
            k,
            gamma,
            SamplingParams(),
            seed=i,
        )
        for i in range(batch)
    ]
    per_step, sites = [], Counter()
    with FakeCuda() as dev:
        for r in reqs:
            engine.add(r)
        for step in range(warm + steps):
            dev.reset()
            engine.step()
            if step >= warm:
                per_step.append(dev.launches)
                sites.update(dev.kernel_sites)
        while engine.active:
            engine.cancel(engine.active[-1].request_id)
    return statistics.median(per_step), Counter({s: c / steps for s, c in sites.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", choices=["tiny", "default"], default="tiny")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--sites", type=int, default=6, help="top sites shown per row")
    args = ap.parse_args()
    torch.set_num_threads(2)
    draft, target = (
        (TINY_DRAFT, TINY_TARGET) if args.pair == "tiny" else (DEFAULT_DRAFT, DEFAULT_TARGET)
    )
    engines = {}
    for graphs in (True, False):
        with FakeCuda():
            engine, _ = build_engine(str(draft), str(target), max_batch=max(args.batch),
                                     max_len=512, device="cuda", packed=False)  # fmt: skip
            if graphs:
                engine.draft.use_graphs(emulate=True)
                engine.target.use_graphs(emulate=True)
        engines[graphs] = engine
    print(f"pair {args.pair}: kernels launched eagerly per step (a graph replay counts one)")
    print("| method | K | γ | batch | graphs | no graphs | where (graphs; per step) |")
    print("|---|---|---|---|---|---|---|")
    for method, k, gamma in CONFIGS:
        for batch in args.batch:
            on, sites = launches(engines[True], method, k, gamma, batch, args.steps, warm=2)
            off, _ = launches(engines[False], method, k, gamma, batch, args.steps, warm=2)
            top = ", ".join(f"{s} {c:.0f}" for s, c in sites.most_common(args.sites))
            print(
                f"| {method} | {k} | {gamma} | {batch} | {on:.0f} | {off:.0f} | {top} |", flush=True
            )


if __name__ == "__main__":
    main()
