"""How often a seeded request's tokens change with its batch-mates, per weight dtype.

    .venv/bin/python scripts/seeded_batch_mates.py [--requests 8] [--new-tokens 48] \
        [--dtypes float32 bfloat16] [--threads 1]

The in-process engine on the default pair decodes HumanEval chat prompts (T = 1, a mix of
`gbv` K = 2 γ = 4, `block` γ = 4, `token` γ = 3 and `none`, each request its own seed) once all
together and once each alone, and prints which requests' tokens differ. A seed fixes every
random draw (docs/client.md); what batch-mates move is the last bits of p and q (padded shapes,
another summation order), which can move a draw that lands near a threshold: how often depends
on how coarse the last bit is.
"""

from __future__ import annotations

import argparse

import torch

from blockspec.loadtest.prompts import prompt_ids
from blockspec.service.build import build_engine
from blockspec.service.requests import make_request
from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET
from blockspec.workers.sampling import SamplingParams

METHODS = [("gbv", 2, 4), ("block", 1, 4), ("token", 1, 3), ("none", 1, 1)]


def changed_requests(dtype: str, count: int, new_tokens: int) -> list[str]:
    """The requests (index and method) whose tokens differ alone against all together."""
    engine, tokenizer = build_engine(str(DEFAULT_DRAFT), str(DEFAULT_TARGET), count, dtype=dtype)
    prompts = prompt_ids(tokenizer, "humaneval", count, 900)
    kinds = [METHODS[i % len(METHODS)] for i in range(count)]
    requests = [
        make_request(engine.limits, p, new_tokens, *kind, SamplingParams(1.0), seed=i)
        for i, (p, kind) in enumerate(zip(prompts, kinds, strict=True))
    ]
    together = engine.generate(requests)
    alone = [engine.generate([r])[0] for r in requests]
    return [
        f"{i} ({kinds[i][0]})"
        for i, (a, b) in enumerate(zip(together, alone, strict=True))
        if a.token_ids != b.token_ids
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes:
        changed = changed_requests(dtype, args.requests, args.new_tokens)
        print(
            f"{dtype}: {len(changed)} of {args.requests} seeded requests changed alone against "
            f"together: {', '.join(changed) or 'none'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
