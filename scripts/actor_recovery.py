"""How long the replica's engine takes to come back after one of its actors is killed.

    .venv/bin/python scripts/actor_recovery.py [--kills draft target draft target] \
        [--requests 4] [--context 200]

Builds the replica's engine over Ray actors (`build_remote_engine`, the default pair in
float32 unless --draft/--target say otherwise), then, for each kill: adds `--requests` seeded
`block` requests of `--context` random prompt tokens, steps 3 times, `ray.kill`s the draft
actor or the target's rank 0, and times the steps until one finds it lost, the engine's
`recover()` (of which: the actors' restart, `restart_lost`; the rest is the caches' prefill of
every active request again) and the next step. Each kill's requests are then cancelled.
"""

from __future__ import annotations

import argparse
import random
import time

import ray

from blockspec.service.config import ReplicaConfig
from blockspec.service.replica import build_remote_engine
from blockspec.service.requests import make_request
from blockspec.workers.actors import WorkerLost
from blockspec.workers.sampling import SamplingParams


def timed_kill(engine, which: str, requests: int, context: int) -> str:
    rng = random.Random(0)
    for seed in range(requests):
        prompt = [rng.randrange(1000, engine.vocab_size) for _ in range(context)]
        params = SamplingParams(1.0)
        engine.add(make_request(engine.limits, prompt, 400, "block", 1, 4, params, seed=seed))
    for _ in range(3):
        engine.step()
    runner = engine.executor
    victim = (runner.draft if which == "draft" else runner.target).actors[0]
    restart = runner.restart_lost
    seconds = {}

    def timed_restart() -> None:
        start = time.perf_counter()
        restart()
        seconds["restart"] = time.perf_counter() - start

    runner.restart_lost = timed_restart
    start = time.perf_counter()
    ray.kill(victim)  # asynchronous: a step may still finish before the actor is gone
    while True:
        try:
            engine.step()
        except WorkerLost:
            lost = time.perf_counter()
            break
    engine.recover()
    recovered = time.perf_counter()
    engine.step()
    done = time.perf_counter()
    runner.restart_lost = restart
    for active in list(engine.active):
        engine.cancel(active.request_id, park=False)
    return (
        f"{which}: lost after {lost - start:.2f} s, recover {recovered - lost:.2f} s (restart "
        f"{seconds['restart']:.2f} s), next step {done - recovered:.2f} s; "
        f"kill to stepping again {done - start:.2f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", nargs="+", choices=["draft", "target"], default=["draft", "target"])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--draft", help="draft model directory (default: the default pair's)")
    ap.add_argument("--target", help="target model directory (default: the default pair's)")
    args = ap.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    dirs = {"draft_dir": args.draft, "target_dir": args.target}
    cfg = ReplicaConfig(
        max_batch=args.requests, max_sessions=0, **{k: v for k, v in dirs.items() if v}
    )
    engine, _ = build_remote_engine(cfg)
    for which in args.kills:
        print(timed_kill(engine, which, args.requests, args.context), flush=True)


if __name__ == "__main__":
    main()
