"""What `compiled: true` costs a replica at start and gives it after: the replica's engine over
Ray actors (`build_remote_engine`, no gRPC), once with compiled forwards and once eager, both up
at once.

    .venv/bin/python scripts/compiled_service.py [--dtype bfloat16] [--gamma 3] \
        [--prompts 4] [--new-tokens 64] [--rounds 3] [--max-len 1024]

Both replicas declare one shape, `block` K = 1 at `--gamma` (their default method, and their
only auto arm beside `none`). The compiled one's warm-up (service/warm_up.py, as a replica runs
it when it starts: T = 1, greedy and T = 0.7, contexts up to `--max-len`) is timed. Then the
two decode the same seeded HumanEval prompts at batch 1 (T = 1), after one discarded request
each, alternated round by round; tokens/s are decode rates (tokens / (wall − prefill)),
medians, and each round's ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
from transformers import AutoTokenizer

from blockspec.loadtest.prompts import prompt_ids
from blockspec.service.config import ReplicaConfig
from blockspec.service.replica import build_remote_engine, warm_replica
from blockspec.service.requests import make_request
from blockspec.workers.sampling import SamplingParams


def decode_rate(engine, prompts: list[list[int]], gamma: int, new_tokens: int) -> float:
    params = SamplingParams(1.0)
    engine.reset_stats()
    start, tokens = time.perf_counter(), 0
    for seed, prompt in enumerate(prompts):
        req = make_request(engine.limits, prompt, new_tokens, "block", 1, gamma, params, seed=seed)
        tokens += len(engine.generate([req])[0].token_ids)
    return tokens / (time.perf_counter() - start - engine.times.prefill)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=1024)
    args = ap.parse_args()
    ray.init(include_dashboard=False)
    engines = {}
    for compiled in (True, False):
        cfg = ReplicaConfig(
            dtype=args.dtype, max_batch=1, max_len=args.max_len, compiled=compiled,
            default_gamma=args.gamma, auto_arms=["none", f"block/1/{args.gamma}"],
            prefix_caching=False,
        )  # fmt: skip
        start = time.perf_counter()
        engine, _ = build_remote_engine(cfg)
        built = time.perf_counter() - start
        report = warm_replica(engine, cfg)
        name = "compiled" if compiled else "eager"
        print(f"{name}: actors up in {built:.1f} s; warm-up {report.runs} runs, "
              f"{report.seconds:.0f} s", flush=True)  # fmt: skip
        engines[name] = engine
    tokenizer = AutoTokenizer.from_pretrained(cfg.target_dir, local_files_only=True)
    prompts = prompt_ids(tokenizer, "humaneval", args.prompts, args.max_len - args.new_tokens)
    for engine in engines.values():  # both warm: the eager one's first steps load kernels too
        decode_rate(engine, prompts[:1], args.gamma, 8)
    rates = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in list(engines)[r % 2 :] + list(engines)[: r % 2]:
            rates[name].append(decode_rate(engines[name], prompts, args.gamma, args.new_tokens))
            print(f"round {r} {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    ratios = [c / e for c, e in zip(rates["compiled"], rates["eager"], strict=True)]
    for name, values in rates.items():
        print(f"{name}: median {statistics.median(values):.1f} tok/s")
    print("compiled / eager by round: " + ", ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
