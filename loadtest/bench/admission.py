"""Requests joining at once through the Ray actors: the admission (target prefill, and for a
feature draft the draft's prefill as it streams) and the first step after it.

    blockspec-bench admission [--joining 8] [--rounds 5] [--threads 1]

Each round admits `--joining` HumanEval chat prompts (as the load test sends them: 100-400
tokens, so several padding groups) to an engine over a local draft actor and target shard
(`service.replica.build_remote_engine`, the default pair), times `engine._admit()` and the
first `engine.step()` (which waits for whatever of the draft's prefill is still running),
then cancels the requests. Prints each round, then medians over rounds 1.. (round 0 warms
up). The actors import the driver's blockspec: to compare two revisions, run it with each
revision's package view (loadtest/bench/harness.py, `package_view`) first on PYTHONPATH.
"""

from __future__ import annotations

import statistics
import time

import ray
import torch
from transformers import AutoTokenizer

from blockspec.loadtest.bench.harness import parser
from blockspec.loadtest.prompts import prompt_ids
from blockspec.service.app import start_ray
from blockspec.service.config import ReplicaConfig, Settings
from blockspec.service.replica import build_remote_engine
from blockspec.service.requests import make_request
from blockspec.workers.draft import padding_groups
from blockspec.workers.sampling import SamplingParams


def main(argv: list[str] | None = None) -> None:
    ap = parser("admission", __doc__)
    ap.add_argument("--joining", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per actor")
    args = ap.parse_args(argv)
    n = args.joining
    start_ray(Settings())  # as `blockspec serve` starts it: 127.0.0.1 only
    torch.set_num_threads(args.threads)
    cfg = ReplicaConfig(max_batch=n, torch_threads=args.threads)
    engine, _ = build_remote_engine(cfg)
    prompts = prompt_ids(AutoTokenizer.from_pretrained(cfg.target_dir), "humaneval", 4 * n, 1000)
    admit, first = [], []
    for r in range(args.rounds + 1):
        batch = prompts[r % 4 * n : r % 4 * n + n]
        for i, prompt in enumerate(batch):
            engine.add(
                make_request(engine.limits, prompt, 8, "block", 1, 4, SamplingParams(1.0), seed=i)
            )
        start = time.perf_counter()
        engine._admit()
        admitted = time.perf_counter()
        engine.step()
        stepped = time.perf_counter()
        for a in list(engine.active):
            engine.cancel(a.request_id)
        if r:
            admit.append(admitted - start)
            first.append(stepped - admitted)
        lengths = [len(p) - 1 for p in batch]  # the last prompt token stays pending
        print(
            f"round {r}: {sum(lengths)} tokens in {len(padding_groups(lengths))} groups: admit "
            f"{1e3 * (admitted - start):.0f} ms, first step {1e3 * (stepped - admitted):.0f} ms",
            flush=True,
        )
    total = [a + f for a, f in zip(admit, first, strict=True)]
    print(
        f"{n} joining, {args.threads} thread(s) per actor: median admit "
        f"{1e3 * statistics.median(admit):.0f} ms, first step "
        f"{1e3 * statistics.median(first):.0f} ms, sum {1e3 * statistics.median(total):.0f} ms"
    )
    ray.shutdown()
