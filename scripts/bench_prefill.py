"""Prefill of joining prompts: the way it runs now against one padded batch with logits.

    .venv/bin/python scripts/bench_prefill.py [--target DIR] [--dtype float32] [--joining 8] \\
        [--rounds 6] [--threads 1]

Each round prefills `--joining` HumanEval chat prompts (as the load test sends them: 100-400
tokens on the default pair) into a target's KV cache twice, in alternating order:
- *padded*: one batch padded to the longest prompt, logits computed for every position (how
  `workers.draft.prefill` ran before it split joiners into padding groups and dropped the head);
- *now*: `workers.draft.prefill`.
Prints each round's lengths, groups and seconds, then the medians (first round dropped) and
their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoTokenizer

from loadtest.prompts import prompt_ids
from workers.draft import _prefill_batch, padding_groups, prefill
from workers.llama import KVCache
from workers.models import DEFAULT_TARGET, DTYPES, load_model


class _WithLogits:
    """The model, computing logits even where the caller asks for none."""

    def __init__(self, model):
        self.model, self.spec = model, model.spec

    def __call__(self, *args, head: bool = True, **kwargs):
        return self.model(*args, head=True, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--joining", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.joining
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = prompt_ids(tokenizer, "humaneval", 4 * n, room=1000)
    model = load_model(args.target, args.dtype, "cpu").build()
    cache = KVCache(model.spec, model.kv_heads, n, 1024, DTYPES[args.dtype], "cpu")

    def padded(contexts):
        cache.lengths[:n] = 0
        _prefill_batch(_WithLogits(model), cache, 0, contexts, None)

    def now(contexts):
        prefill(model, cache, 0, contexts)

    seconds = {"padded": [], "now": []}
    for r in range(args.rounds):
        first = r % 4 * n
        contexts = [torch.tensor(p[:-1]) for p in prompts[first : first + n]]  # last: pending
        order = [("padded", padded), ("now", now)]
        for name, fn in order if r % 2 else order[::-1]:
            start = time.perf_counter()
            fn(contexts)
            seconds[name].append(time.perf_counter() - start)
        lengths = [len(c) for c in contexts]
        print(
            f"round {r}: lengths {lengths}, groups {padding_groups(lengths)}: padded "
            f"{seconds['padded'][-1]:.2f} s, now {seconds['now'][-1]:.2f} s",
            flush=True,
        )
    padded_s, now_s = (statistics.median(seconds[k][1:]) for k in ("padded", "now"))
    print(
        f"{args.dtype}, {n} joining, {args.threads} thread(s): median padded {padded_s:.2f} s, "
        f"now {now_s:.2f} s: {padded_s / now_s:.2f}x"
    )


if __name__ == "__main__":
    main()
