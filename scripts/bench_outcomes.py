"""How often a speculation cache of F entries would hold the step's real outcome (its hit rate),
per verifier, on the default pair (workers/outcomes.py has the vocabulary and the predictor).

The engine runs every request with one more draft token than it verifies (γ + 1 drafted, the
first γ verified, exactly as a γ request: the extra token is never read), so that the draft's
row after the whole path, what ranks the bonus token, exists as it would when a cache is
built. After each step the predictor's F likeliest outcomes, from the draft alone, are
compared with the prefix the verifier emitted. This measures the predictor, not a cache: no
proposal is prepared or reused here.

    .venv/bin/python scripts/bench_outcomes.py --json docs/outcomes.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import service.engine as engine_module  # noqa: E402
from loadtest.everyday import everyday_ids  # noqa: E402
from service.engine import build_engine  # noqa: E402
from service.requests import make_request  # noqa: E402
from workers.models import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from workers.outcomes import actual_outcomes, predict_outcomes  # noqa: E402
from workers.sampling import SamplingParams  # noqa: E402

PREDICTORS = ("constant", "confidence")


class Recorder:
    """Wraps the engine's verify_step: verifies the first γ of γ + 1 drafted tokens and counts
    the predictor's hits, per predictor and fan-out."""

    def __init__(self, fanouts: list[int]):
        self.fanouts = fanouts
        self.hits = {(p, f): 0 for p in PREDICTORS for f in fanouts}
        self.outcomes = 0
        self.accepted, self.tried = 1.0, 2.0  # running acceptance rate, prior 0.5
        self.original = engine_module.verify_step

    def __call__(self, plan, x, q, p, generators):
        if q is None:
            return self.original(plan, x, q, p, generators)
        gamma = x.shape[2] - 1
        groups = [(m, k, g - 1, rows) for m, k, g, rows in plan.groups]
        short = replace(plan, groups=groups, max_gamma=plan.max_gamma - 1)
        verdict = self.original(
            short, x[:, :, :gamma], q[:, :, :gamma], p[:, :, : gamma + 1], generators
        )
        wide = torch.full((x.shape[0], gamma + 2), -1, dtype=torch.int64)
        wide[:, : gamma + 1] = verdict.tokens
        self.count(x[:, :, :gamma], q, verdict)
        return replace(verdict, tokens=wide)

    def count(self, x, q, verdict) -> None:
        tau = verdict.num_accepted
        actual = actual_outcomes(x, tau, verdict.path, verdict.tokens)
        drafted = q[:, :, : x.shape[2]].gather(-1, x[..., None])[..., 0]  # [n, K, γ]
        accept = {
            "constant": torch.full_like(drafted, self.accepted / self.tried),
            "confidence": drafted,
        }
        for name in PREDICTORS:  # the F likeliest are the first F of the ranking
            ranked = predict_outcomes(x, q, accept[name], max(self.fanouts))
            for f in self.fanouts:
                self.hits[name, f] += sum(a in r[:f] for a, r in zip(actual, ranked, strict=True))
        self.outcomes += len(actual)
        gamma = x.shape[2]
        self.accepted += float(tau.sum())
        self.tried += float((tau + (tau < gamma)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--methods", nargs="+", default=["block", "gbv"])
    ap.add_argument("--k", type=int, default=2, help="K of gbv (block: 1)")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--fanout", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--per-kind", type=int, default=2, help="everyday prompts per kind")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine, tok = build_engine(args.draft, args.target, args.batch, 1024)
    room = 1024 - args.new_tokens - 8
    prompts = [ids for _, ids in everyday_ids(tok, room, args.per_kind)]
    result = dict(prompts=len(prompts), new_tokens=args.new_tokens, rows={})
    started = time.time()
    for method in args.methods:
        k = args.k if method == "gbv" else 1
        recorder = Recorder(args.fanout)
        engine_module.verify_step = recorder
        try:
            reqs = [
                make_request(
                    engine.limits,
                    p,
                    args.new_tokens,
                    method,
                    k,
                    args.gamma + 1,
                    SamplingParams(args.temperature),
                    seed=i,
                )
                for i, p in enumerate(prompts)
            ]
            engine.generate(reqs)
        finally:
            engine_module.verify_step = recorder.original
        rate = {f"{p} F={f}": h / recorder.outcomes for (p, f), h in recorder.hits.items()}
        key = f"{method} K={k} gamma={args.gamma} T={args.temperature}"
        result["rows"][key] = dict(outcomes=recorder.outcomes, hit_rate=rate)
        print(key, recorder.outcomes, {n: round(v, 3) for n, v in rate.items()}, flush=True)
    result["minutes"] = round((time.time() - started) / 60, 1)
    result["command"] = "python " + " ".join(sys.argv)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
