"""Ceilings this machine sets on the speed goals, measured: forward costs, two processes
computing at once, and the Ray floor of one distributed step.

    .venv/bin/python scripts/bench_bounds.py [--rounds 3] [--skip-ray]

1. **Forward costs** of the default pair (float32, 1 thread, 200-token cache), medians over
   rounds: r(n), the target's pass over n new tokens ÷ its one-token pass, and c, the draft's
   one-token forward ÷ the target's. A batch-1 step of a single-path method with γ draft
   tokens costs at least γ draft forwards and one (γ+1)-token target pass, so its speedup over
   plain decoding is at most BE / (r(γ+1) + γ·c) for block efficiency BE (verification,
   sampling and bookkeeping only add). Printed per γ: that denominator, the BE a 1.5× speedup
   needs, and the per-token acceptance α at which token verification reaches that BE,
   (1 − α^(γ+1)) / (1 − α).
2. **Two processes at once**: the target's 5-token pass alone, and while another process
   loops the draft's forward (as a draft actor pre-drafting beside the target would), rounds
   alternating. On a machine whose cores are independent the ratio is 1.
3. **The Ray floor of a step** (unless --skip-ray): driver → actor A → actor B → driver, B
   reading A's reply by reference, with the tiny pair's batch-1 payloads (5 KB of arguments,
   a 128 KiB reply from A, 5 KB from B), against one bare call; nothing computed.
4. **Where a step's CPU goes** (unless --skip-ray): the tiny pair at batch 1 (`block`, γ = 4,
   192 tokens), first in process, then through a draft actor and a target shard
   (`build_remote_engine`, no gRPC): wall and machine-wide busy CPU per step, and each
   process's CPU per step by thread name (Ray's I/O and polling threads apart from the main
   thread that computes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from bench_engine import forward_ms

from service.engine import build_engine
from service.requests import make_request
from workers.models import DEFAULT_DRAFT, DEFAULT_TARGET, TINY_DRAFT, TINY_TARGET, load_model
from workers.sampling import SamplingParams

GAMMAS = (2, 3, 4, 6)


def forward_costs(rounds: int) -> tuple[dict[int, float], float, float]:
    """(r(n) for n in 1 + GAMMAS, c, the target's one-token ms): medians over rounds."""
    target = load_model(DEFAULT_TARGET, "float32").build()
    draft = load_model(DEFAULT_DRAFT, "float32").build()
    sizes = (1, *(g + 1 for g in GAMMAS))
    ms: dict[str, list[float]] = {}
    for _ in range(rounds):
        for n in sizes:
            ms.setdefault(f"t{n}", []).append(forward_ms(target, n, repeats=7))
        ms.setdefault("d1", []).append(forward_ms(draft, 1, repeats=7))
    med = {k: statistics.median(v) for k, v in ms.items()}
    one = med["t1"]
    return {n: med[f"t{n}"] / one for n in sizes}, med["d1"] / one, one


def token_alpha_for(be: float, gamma: int) -> float:
    """α with (1 − α^(γ+1)) / (1 − α) = be (bisection; nan if be ≥ γ + 1)."""
    if be >= gamma + 1:
        return float("nan")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**i for i in range(gamma + 1)) < be else (lo, a)
    return (lo + hi) / 2


def draft_loop() -> None:  # the other process of part 2; killed by its parent
    draft = load_model(DEFAULT_DRAFT, "float32").build()
    while True:
        forward_ms(draft, 1, repeats=5)


def contention(rounds: int) -> tuple[list[float], list[float]]:
    target = load_model(DEFAULT_TARGET, "float32").build()
    alone, beside = [], []
    for _ in range(rounds):
        alone.append(forward_ms(target, 5, repeats=11))
        loop = subprocess.Popen(
            [sys.executable, __file__, "--draft-loop"], stderr=subprocess.DEVNULL
        )
        time.sleep(8)  # loaded its weights and looping
        beside.append(forward_ms(target, 5, repeats=11))
        loop.kill()
        loop.wait()
    return alone, beside


def ray_floor(calls: int = 200) -> tuple[float, float]:
    """(one bare call, the chained step), median ms."""
    import numpy as np
    import ray

    from service.app import start_ray
    from service.config import Settings

    start_ray(Settings(ray_num_cpus=2))

    @ray.remote
    class Proposer:
        def propose(self, args):
            return np.ones(32 << 10, np.float32)  # 128 KiB: q rows of one request

    @ray.remote
    class Scorer:
        def score(self, rows, args):
            return np.ones(1250, np.float32)  # 5 KB: tokens, τ, generator state

    a, b = Proposer.remote(), Scorer.remote()
    args = (np.zeros(1250, np.float32),)  # 5 KB: pending tokens, generator state
    ray.get([a.propose.remote(args), b.score.remote(None, args)])
    one, chain = [], []
    for _ in range(calls):
        start = time.perf_counter()
        ray.get(a.propose.remote(args))
        one.append(time.perf_counter() - start)
        start = time.perf_counter()
        ray.get(b.score.remote(a.propose.remote(args), args))
        chain.append(time.perf_counter() - start)
    ray.shutdown()
    return statistics.median(one) * 1e3, statistics.median(chain) * 1e3


def _busy_s() -> float:
    """Machine-wide busy CPU seconds (user, nice, system, irq, softirq)."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(f[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(pid: int) -> Counter:
    """CPU seconds of each thread name of a process."""
    out: Counter = Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[stat[stat.index("(") + 1 : stat.rindex(")")]] += int(fields[11]) + int(fields[12])
    return Counter({k: v / os.sysconf("SC_CLK_TCK") for k, v in out.items()})


def step_cpu(engine, pids: dict[str, int]) -> tuple[float, float, dict[str, Counter]]:
    """One request decoded to the end after its first step: (wall ms a step, busy CPU ms a
    step, per process: CPU ms a step by thread name)."""
    prompt = list(range(100, 160))
    engine.add(make_request(engine.limits, prompt, 192, "block", 1, 4, SamplingParams(1.0), seed=0))
    engine.step()  # admission
    before = {k: _thread_cpu_s(p) for k, p in pids.items()}
    busy, start, steps = _busy_s(), time.perf_counter(), 0
    while engine.active:
        engine.step()
        steps += 1
    wall, busy = time.perf_counter() - start, _busy_s() - busy
    after = {k: _thread_cpu_s(p) for k, p in pids.items()}
    per = {
        k: Counter({t: 1e3 * (after[k][t] - before[k][t]) / steps for t in after[k]}) for k in pids
    }
    return 1e3 * wall / steps, 1e3 * busy / steps, per


def cpu_split() -> None:
    import ray

    from service.app import start_ray
    from service.config import ReplicaConfig, Settings
    from service.replica import build_remote_engine

    local, _ = build_engine(str(TINY_DRAFT), str(TINY_TARGET), 1)
    rows = [("in process", *step_cpu(local, {"engine": os.getpid()}))]
    start_ray(Settings(ray_num_cpus=2))
    cfg = ReplicaConfig(draft_dir=str(TINY_DRAFT), target_dir=str(TINY_TARGET), max_batch=1)
    engine, _ = build_remote_engine(cfg)

    def pid(actor) -> int:
        return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))

    pids = {"coordinator": os.getpid(), "draft actor": pid(engine.draft.actors[0]),
            "target actor": pid(engine.target.actors[0])}  # fmt: skip
    rows.append(("actors", *step_cpu(engine, pids)))
    for actor in engine.draft.actors + engine.target.actors:
        ray.kill(actor)
    ray.shutdown()
    print("\n## 4. Where a step's CPU goes (tiny pair, batch 1)\n")
    for path, wall, busy, per in rows:
        print(f"{path}: {wall:.1f} ms a step, machine-wide busy CPU {busy:.1f} ms a step")
        for name, threads in per.items():
            top = ", ".join(f"{t} {ms:.2f}" for t, ms in threads.most_common() if ms >= 0.05)
            print(f"    {name} (CPU ms a step by thread): {top}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--draft-loop", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.draft_loop:
        return draft_loop()
    print(f"python scripts/bench_bounds.py --rounds {args.rounds}; torch {torch.__version__}")

    r, c, one = forward_costs(args.rounds)
    print(f"\n## 1. Forward costs (float32, 1 thread): target one token {one:.1f} ms, c = {c:.3f}")
    print()
    print("| γ | r(γ+1) | r(γ+1) + γc | BE for 1.5× | token-verification α for it |")
    print("|---|---|---|---|---|")
    for g in GAMMAS:
        denom = r[g + 1] + g * c
        be = 1.5 * denom
        print(f"| {g} | {r[g + 1]:.2f} | {denom:.2f} | {be:.2f} | {token_alpha_for(be, g):.2f} |")

    alone, beside = contention(args.rounds)
    ratio = statistics.median(beside) / statistics.median(alone)
    print("\n## 2. The target's 5-token pass, alone and beside a draft loop in another process\n")
    print(f"alone ms: {', '.join(f'{x:.1f}' for x in alone)}")
    print(f"beside ms: {', '.join(f'{x:.1f}' for x in beside)}")
    print(f"median beside ÷ alone: {ratio:.2f}")

    if not args.skip_ray:
        bare, chain = ray_floor()
        print("\n## 3. Ray floor of one distributed step (nothing computed)\n")
        print(f"one call {bare:.2f} ms; driver → A → B → driver {chain:.2f} ms")
        cpu_split()


if __name__ == "__main__":
    main()
