"""How often a speculation cache of F entries would hold the step's real outcome (its hit rate),
per verifier, on the default pair (workers/outcomes.py has the vocabulary and the predictor).

The engine runs every request with one more draft token than it verifies (γ + 1 drafted, the
first γ verified, exactly as a γ request: the extra token is never read), so that the draft's
row after the whole path, what ranks the bonus token, exists as it would when a cache is
built. After each step the predictor's F likeliest outcomes, from the draft alone, are
compared with the prefix the verifier emitted. This measures the predictor, not a cache: no
proposal is prepared or reused here.

Beside the sampled hits, each step's exact outcome law given the target's rows too
(`outcome_law`, token / block / gbv) gives, without the noise of one draw, every predictor's
expected hit rate (the law's mass on the outcomes it ranked first) and the `ceiling`: the mass
of the law's own F likeliest outcomes, which no predictor ranking before verification can
beat on these drafts. It also checks that the emitted outcome had positive probability.
Where the draft's predictor loses (one path: token, block): `exact tau` ranks with the law's
τ and the draft's estimate of y given τ, `exact y` with the draft's τ (the constant
acceptance) and the law's y given τ; each scored by the law's mass on its first F.
`--downweight` < 1 runs Saguaro sampling (the draft's top max(F) tokens scaled by it:
workers/sampling.downweight_top), another lossless draft law with its own ceiling; the
predictor then ranks y by the residual the cache estimates (speculation.residual_estimate).

    blockspec-bench outcomes --per-kind 7 --new-tokens 48 \
        --methods token block gbv --json docs/outcomes_t1.0.json
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

import blockspec.workers.step as step_module
from blockspec.loadtest.bench.harness import parser, save_json
from blockspec.loadtest.everyday import everyday_ids
from blockspec.service.build import build_engine
from blockspec.service.requests import make_request
from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET
from blockspec.workers.outcomes import (
    LAW_METHODS,
    actual_outcomes,
    law_mass,
    outcome_law,
    outcome_scores,
    predict_outcomes,
)
from blockspec.workers.sampling import SamplingParams
from blockspec.workers.speculation import residual_estimate

PREDICTORS = ("constant", "confidence")
LAW_ROWS = ("ceiling", "exact tau", "exact y")  # ranked with the law, wholly or in part


class Recorder:
    """Wraps the engine's verify_step: verifies the first γ of γ + 1 drafted tokens and counts
    the predictor's hits, per predictor and fan-out."""

    def __init__(self, fanouts: list[int], downweight: tuple[int, float] | None = None):
        self.fanouts = fanouts
        self.downweight = downweight
        self.hits = {(p, f): 0 for p in PREDICTORS for f in fanouts}
        # expected hits (the exact law's mass), per predictor and the ceiling, per fan-out
        self.expected = {(p, f): 0.0 for p in (*PREDICTORS, *LAW_ROWS) for f in fanouts}
        self.single_path = 0  # outcomes that the hybrid rows (one path) were computed on
        self.lawful = 0  # outcomes whose law was computed
        self.outcomes = 0
        self.accepted, self.tried = 1.0, 2.0  # running acceptance rate, prior 0.5
        self.emitted = 0.0  # tokens emitted by the steps (τ + 1 each): block efficiency
        self.original = step_module.verify_step

    def __call__(self, plan, x, q, p):
        if q is None:
            return self.original(plan, x, q, p)
        gamma = x.shape[2] - 1
        groups = [(m, k, g - 1, rows) for m, k, g, rows in plan.groups]
        short = replace(plan, groups=groups, max_gamma=plan.max_gamma - 1)
        verdict = self.original(short, x[:, :, :gamma], q[:, :, :gamma], p[:, :, : gamma + 1])
        wide = torch.full((x.shape[0], gamma + 2), -1, dtype=torch.int64)
        wide[:, : gamma + 1] = verdict.tokens
        x = x[:, :, :gamma]
        rate = self.accepted / self.tried  # the running acceptance rate before this step
        ranked, rows = self.rank(x, q, rate)
        self.count(x, verdict, ranked)
        self.weigh(plan, x, q, p[:, :, : gamma + 1], verdict, ranked, rows, rate)
        tau = verdict.num_accepted
        self.emitted += float((tau + 1).sum())
        self.accepted += float(tau.sum())
        self.tried += float((tau + (tau < gamma)).sum())
        return replace(verdict, tokens=wide)

    def rank(self, x, q, rate: float) -> tuple[dict, torch.Tensor]:
        """Each predictor's ranking of the outcomes, and the rows it ranked y with."""
        drafted = q[:, :, : x.shape[2]].gather(-1, x[..., None])[..., 0]  # [n, K, γ]
        accept = {"constant": torch.full_like(drafted, rate), "confidence": drafted}
        rows = q
        if self.downweight is not None:  # y ranked where the Saguaro residual is expected
            rows = torch.cat([residual_estimate(q[:, :, :-1], *self.downweight), q[:, :, -1:]], 2)
        top = max(self.fanouts)  # the F likeliest are the first F of the ranking
        return {name: predict_outcomes(x, rows, accept[name], top) for name in PREDICTORS}, rows

    def count(self, x, verdict, ranked: dict) -> None:
        """The sampled hits: the emitted outcome among each predictor's first F."""
        actual = actual_outcomes(x, verdict.num_accepted, verdict.path, verdict.tokens)
        for name in PREDICTORS:
            for f in self.fanouts:
                hits = zip(actual, ranked[name], strict=True)
                self.hits[name, f] += sum(a in r[:f] for a, r in hits)
        self.outcomes += len(actual)

    def weigh(self, plan, x, q, p, verdict, ranked: dict, ranked_rows, rate: float) -> None:
        """The exact law of each group's outcomes: expected hits and the ceiling."""
        gamma = x.shape[2]
        for method, k, _, rows in plan.groups:
            if method not in LAW_METHODS:
                continue
            idx = torch.tensor(rows)
            path, law = outcome_law(method, x[idx], q[idx, :, :gamma], p[idx])
            if k == 1:
                self.hybrids(law, x[idx, 0], ranked_rows[idx, 0], rate)
            assert (path == verdict.path[idx]).all(), "the law's path is not the verifier's"
            chosen = x[idx, path]  # [m, γ]
            tau, emitted = verdict.num_accepted[idx], verdict.tokens[idx]
            emitted_prob = law[torch.arange(len(rows)), tau, emitted.gather(1, tau[:, None])[:, 0]]
            assert (emitted_prob > 0).all(), "an outcome of probability 0 was emitted"
            top = law.flatten(1).topk(max(self.fanouts), dim=-1).values.cumsum(-1)  # [m, F]
            for f in self.fanouts:
                self.expected["ceiling", f] += float(top[:, f - 1].sum())
                for name in PREDICTORS:
                    prepared = [ranked[name][i][:f] for i in rows]
                    self.expected[name, f] += sum(law_mass(law, chosen, prepared))
            self.lawful += len(rows)

    def hybrids(
        self,
        law: torch.Tensor,  # [m, γ+1, V]: the exact law on the one path
        x: torch.Tensor,  # [m, γ]
        q: torch.Tensor,  # [m, γ+1, V]: the rows the predictor ranks y with
        rate: float,  # the constant estimate of acceptance
    ) -> None:
        """The rows `exact tau` and `exact y`: half the ranking from the law, half the draft's."""
        tau_law = law.sum(-1, keepdim=True)  # [m, γ+1, 1]
        y_law = law / tau_law.clamp_min(1e-300)
        accept = torch.full_like(x, rate, dtype=q.dtype)
        draft = outcome_scores(x[:, None], q[:, None], accept[:, None])[:, 0].double()
        tau_draft = draft.sum(-1, keepdim=True)
        y_draft = draft / tau_draft.clamp_min(1e-300)
        for name, scores in (("exact tau", tau_law * y_draft), ("exact y", tau_draft * y_law)):
            top = scores.flatten(1).topk(max(self.fanouts), dim=-1).indices  # [m, F]
            mass = law.flatten(1).gather(1, top).cumsum(-1)  # one path: every entry its own
            for f in self.fanouts:
                self.expected[name, f] += float(mass[:, f - 1].sum())
        self.single_path += len(x)


def main(argv: list[str] | None = None) -> None:
    ap = parser("outcomes", __doc__)
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
    ap.add_argument(
        "--downweight", type=float, default=1.0, help="Saguaro factor (< 1) for the top max(F)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine, tok = build_engine(args.draft, args.target, args.batch, 1024)
    room = 1024 - args.new_tokens - 8
    prompts = [ids for _, ids in everyday_ids(tok, room, args.per_kind)]
    result = dict(prompts=len(prompts), new_tokens=args.new_tokens, rows={})
    started = time.time()
    for method in args.methods:
        k = args.k if method == "gbv" else 1
        saguaro = (max(args.fanout), args.downweight) if args.downweight < 1 else None
        recorder = Recorder(args.fanout, saguaro)
        engine.executor.draft.downweight = saguaro
        step_module.verify_step = recorder
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
            step_module.verify_step = recorder.original
        rate = {f"{p} F={f}": h / recorder.outcomes for (p, f), h in recorder.hits.items()}
        per = {p: recorder.lawful for p in (*PREDICTORS, "ceiling")}
        per |= {p: recorder.single_path for p in LAW_ROWS[1:]}
        expected = {f"{p} F={f}": e / per[p] for (p, f), e in recorder.expected.items() if per[p]}
        key = f"{method} K={k} gamma={args.gamma} T={args.temperature}"
        if saguaro:
            key += f" saguaro={args.downweight}"
        result["rows"][key] = dict(
            outcomes=recorder.outcomes,
            block_efficiency=recorder.emitted / recorder.outcomes,
            hit_rate=rate,
            expected_hit_rate=expected,
        )
        be = round(recorder.emitted / recorder.outcomes, 3)
        print(key, recorder.outcomes, be, {n: round(v, 3) for n, v in rate.items()}, flush=True)
        print("  expected", {n: round(v, 3) for n, v in expected.items()}, flush=True)
    result["minutes"] = round((time.time() - started) / 60, 1)
    save_json(args.json, "outcomes", argv, result)
