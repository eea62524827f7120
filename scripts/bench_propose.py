"""The draft's propose step, this checkout against a baseline revision's, side by side.

    .venv/bin/python scripts/bench_propose.py [--baseline 0070e89] [--draft DIR] \\
        [--dtype bfloat16] [--repeats 15] [--threads 1]

Loads `workers/draft.py` as it was at `--baseline` (git show; a revision from before the draft
was split into proposers, whose `DraftWorker` it builds) next to this checkout's proposer
(`build_proposer`), one of each on the same model (a 200-token cache per request, random
features for a feature draft), and times `propose` on the same inputs and seeds for a few
shapes: batch 1 and 8, K = 1 and 2, T = 1 and T = 0.7 with top_p = 0.9. Prints the medians (the
better of two passes each, first two calls dropped), their ratio, whether the drafted tokens
are identical and the largest difference between the two q.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
import types
from pathlib import Path

import torch

from workers.models import DEFAULT_DRAFT, DTYPES, load_model
from workers.proposers import build_proposer
from workers.sampling import SamplingParams

SHAPES = [  # (batch, K, γ, sampling)
    (1, 1, 4, SamplingParams(1.0)),
    (1, 2, 3, SamplingParams(1.0)),
    (1, 1, 4, SamplingParams(0.7, top_p=0.9)),
    (8, 1, 4, SamplingParams(1.0)),
    (8, 2, 3, SamplingParams(1.0)),
]


def baseline_worker_class(rev: str) -> type:
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:workers/draft.py"], cwd=root, check=True, capture_output=True,
        text=True,
    ).stdout  # fmt: skip
    module = types.ModuleType("baseline_draft")
    exec(compile(source, f"{rev}:workers/draft.py", "exec"), module.__dict__)
    return module.DraftWorker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="0070e89", help="git revision to compare against")
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.draft, args.dtype, "cpu").build()
    E, V = model.spec.hidden_size, model.spec.vocab_size
    feature = model.feature_fc is not None
    classes = {"baseline": baseline_worker_class(args.baseline), "now": build_proposer}

    def worker(cls, n: int):
        w = cls(model, n, 1024, DTYPES[args.dtype], "cpu")
        g = torch.Generator().manual_seed(0)
        contexts = [torch.randint(0, V, (200,), generator=g) for _ in range(n)]
        feats = [torch.randn(200, E, generator=g) for _ in range(n)] if feature else None
        w.prefill(0, contexts, [0] * n, feats)
        return w

    def timed(w, n: int, k: int, gamma: int, params: SamplingParams):
        seconds, out = [], None
        for r in range(args.repeats):
            g = torch.Generator().manual_seed(r)
            pending = torch.randint(0, V, (n, 2), generator=g)
            feats = torch.randn(n, 2, E, generator=g) if feature else None
            gens = [torch.Generator().manual_seed(100 + r + i) for i in range(n)]
            w.cache.lengths[:n] = 200
            start = time.perf_counter()
            out = w.propose(pending, torch.full((n,), 2), [k] * n, [gamma] * n, [params] * n,
                            gens, feats)  # fmt: skip
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds[2:]) * 1e3, out

    print(f"{args.draft}, {args.dtype}, {args.threads} thread(s); baseline {args.baseline}")
    for n, k, gamma, params in SHAPES:
        workers = {name: worker(cls, n) for name, cls in classes.items()}
        ms, outs = {}, {}
        for name, w in [*workers.items(), *workers.items()]:  # two alternating passes
            t, outs[name] = timed(w, n, k, gamma, params)
            ms[name] = min(t, ms.get(name, t))
        (x0, q0), (x1, q1) = outs["baseline"], outs["now"]
        print(
            f"batch {n} K={k} γ={gamma} T={params.temperature} top_p={params.top_p}: baseline "
            f"{ms['baseline']:.1f} ms, now {ms['now']:.1f} ms ({ms['baseline'] / ms['now']:.2f}x);"
            f" tokens identical {torch.equal(x0, x1)}, max |Δq| {float((q0 - q1).abs().max()):.2g}",
            flush=True,
        )


if __name__ == "__main__":
    main()
