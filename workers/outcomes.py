"""Predicting a step's verification outcome from the draft alone: the keys of a speculation
cache (speculative speculative decoding, SSD / Saguaro, arXiv 2603.03251).

Vocabulary: a step drafts K paths of γ tokens x [K, γ] from rows q; verification accepts the
first τ tokens of one path and emits one more token y: recovered (drawn from the verifier's
residual after a rejection at depth τ < γ) or the bonus (drawn from the target's row after
the whole path, τ = γ). The *outcome* is that prefix, x[path, :τ] + [y]: the next step's
proposal depends on nothing else (and on the draft's own randomness), so a draft that
prepares proposals for the F likeliest outcomes while the target verifies needs no drafting
at all when the real outcome is among them (a *hit*).

The draft does not know p, so the predictor ranks outcomes with the draft's own view:
P(reach depth j on path k) = (1/K) Π_{i<j} a[k, i] with a the estimated chance that x[k, i] is
accepted; a rejection at j emits y ∝ q[k, j](y) over y ≠ x[k, j] (the residual (p - q)+ has
mass where p exceeds q, unknown: the draft's next choices are its best guess); the bonus y
∝ q[k, γ](y), the draft's row after the path. Two estimates of a: a constant (the running
acceptance rate) or the draft's confidence in its token, q[k, i](x[k, i]). Paths that share
their first τ tokens emit the same prefix for the same y: its estimate is their sum.

`outcome_law` is the other side: the exact law of the outcome given the step's draft *and*
the target's rows p, which the verifier's uniforms then decide. No predictor that ranks
outcomes before verification, from anything independent of those uniforms, holds the real
outcome among F more often than the F likeliest outcomes of that law do (their mass): the
ceiling of a speculation cache's hit rate on a given pair, and, for any predictor, its
expected hit rate (the law's mass on the outcomes it prepared) without the noise of one draw.
"""

from __future__ import annotations

import torch

from blockspec.verification import Backend
from blockspec.verification.block import level_probs, residual_mass, running_products
from blockspec.verification.common import positive_part_or, take_rows
from blockspec.verification.gbv import select_path, skewed_draft

LAW_METHODS = ("token", "block", "gbv")


def outcome_scores(
    x: torch.Tensor,  # [n, K, γ] int64: draft tokens
    q: torch.Tensor,  # [n, K, γ+1, V]: q[:, :, j] the row x_j was drawn from; [:, :, γ] the next
    accept: torch.Tensor,  # [n, K, γ]: estimated P(x[k, j] accepted | x[k, :j] accepted)
) -> torch.Tensor:
    """Estimated probability of every outcome (path k, τ = j, y) [n, K, γ+1, V]."""
    n, k, gamma = x.shape
    ones = torch.ones(n, k, 1, dtype=accept.dtype, device=accept.device)
    reach = torch.cat([ones, accept.cumprod(-1)], dim=-1) / k  # [n, K, γ+1]
    stop = torch.cat([1 - accept, ones], dim=-1)  # [n, K, γ+1]: rejected at j, or the bonus
    rows = q.clone()
    drafted = rows[:, :, :gamma].gather(-1, x[..., None])  # [n, K, γ, 1]
    rows[:, :, :gamma].scatter_(-1, x[..., None], 0.0)  # a rejected token is not re-emitted
    rows[:, :, :gamma] /= (1 - drafted).clamp_min(1e-12)
    return (reach * stop)[..., None] * rows


def merged_by_prefix(
    x: torch.Tensor,  # [n, K, γ] int64
    scores: torch.Tensor,  # [n, K, γ+1, V]: outcome_scores
) -> torch.Tensor:
    """The scores with each prefix's outcomes summed onto its first path: paths that share
    their first τ tokens emit the same prefix x[k, :τ] + [y], whose probability is the sum of
    theirs (multi-path methods: K paths from one root always share τ = 0). [n, K, γ+1, V],
    zero on the other paths' shared entries."""
    n, k = x.shape[:2]
    same = x[:, :, None, :] == x[:, None, :, :]  # [n, K, K', γ]
    ones = torch.ones(n, k, k, 1, dtype=torch.bool, device=x.device)
    shared = torch.cat([ones, same.cumprod(-1).bool()], dim=-1)  # [n, K, K', γ+1]: x[:τ] equal
    first = shared.int().argmax(dim=2)  # [n, K, γ+1]: the first path with that prefix
    index = first[..., None].expand_as(scores)
    return torch.zeros_like(scores).scatter_add_(1, index, scores)


def predict_outcomes(
    x: torch.Tensor,  # [n, K, γ] int64
    q: torch.Tensor,  # [n, K, γ+1, V]
    accept: torch.Tensor,  # [n, K, γ]
    fanout: int,
) -> list[list[tuple[int, ...]]]:
    """Per request, the `fanout` likeliest prefixes x[k, :j] + [y], likeliest first (so its
    first F are the F likeliest), each once: the outcomes of paths that share their first
    tokens are summed (`merged_by_prefix`). Outcomes estimated at 0 come last but are kept:
    the estimate is the draft's view, and such an outcome can still occur."""
    n, k, gamma = x.shape
    V = q.shape[-1]
    scores = merged_by_prefix(x, outcome_scores(x, q, accept)).flatten(1)  # [n, K·(γ+1)·V]
    # room for the merged paths' zeros: each prefix is listed once, so F distinct are kept
    top = scores.topk(min(fanout * k, scores.shape[1]), dim=-1).indices  # [n, F·K]
    path, rest = top // ((gamma + 1) * V), top % ((gamma + 1) * V)
    tau, y = rest // V, rest % V
    rows, paths, taus, ys = (v.tolist() for v in (x, path, tau, y))
    return [
        list(
            dict.fromkeys(
                (*rows[b][kk][:t], yy) for kk, t, yy in zip(paths[b], taus[b], ys[b], strict=True)
            )
        )[:fanout]
        for b in range(n)
    ]


def actual_outcomes(
    x: torch.Tensor,  # [n, K, γ] int64
    tau: torch.Tensor,  # [n] int64: accepted length
    path: torch.Tensor,  # [n] int64
    tokens: torch.Tensor,  # [n, γ+1] int64: the emitted tokens (the verdict's), -1 padded
) -> list[tuple[int, ...]]:
    """The prefix each request's verification emitted: x[path, :τ] + [y]."""
    rows, t, pth, emitted = x.tolist(), tau.tolist(), path.tolist(), tokens.tolist()
    return [(*rows[b][pth[b]][: t[b]], emitted[b][t[b]]) for b in range(len(t))]


def outcome_law(
    method: str,  # one of LAW_METHODS
    x: torch.Tensor,  # [n, K, γ] int64: draft tokens (K = 1 but for gbv)
    q: torch.Tensor,  # [n, K, γ, V]: the rows they were drawn from
    p: torch.Tensor,  # [n, K, γ+1, V]: the target's rows along each path
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact law of the step's outcome given x, q and p: (path [n] int64, law [n, γ+1, V]
    float64), law[b, τ, y] = P(the verifier emits x[b, path, :τ] + [y]). The path is the one
    the verifier reads: 0, or gbv's selection, which x, q and p decide (no uniform). The rules
    are the verifiers' own (verification/, docs/verification.md §1, §2, §8)."""
    n, k = x.shape[:2]
    if method not in LAW_METHODS or (k > 1 and method != "gbv"):
        raise ValueError(f"outcome_law: method {method!r} with K = {k} (laws: {LAW_METHODS})")
    q, p = q.double(), p.double()
    backend = Backend.TORCH_HOST if x.device.type == "cpu" else Backend.TORCH_DEVICE
    path = torch.zeros(n, dtype=torch.int64, device=x.device)
    if k > 1:  # GBV: block verification of the selected path against the skewed draft q̃
        path = select_path(x, q, p)
        xs, ps = take_rows(x, path), take_rows(p, path)
        q_tilde, q_tilde_x = skewed_draft(xs, take_rows(q, path), ps, k, backend)
        return path, _block_law(xs, q_tilde, ps, q_tilde_x, backend)
    if method == "token":
        return path, _token_law(x[:, 0], q[:, 0], p[:, 0])
    return path, _block_law(x[:, 0], q[:, 0], p[:, 0], None, backend)


def _token_law(
    x: torch.Tensor,  # [n, γ] int64
    q: torch.Tensor,  # [n, γ, V] float64
    p: torch.Tensor,  # [n, γ+1, V] float64
) -> torch.Tensor:
    """Token verification: x_i passes with min(1, p/q) until the first failure, which
    emits y ~ (p - q)_+; after all γ the bonus y ~ p. [n, γ+1, V]"""
    drafted = x.unsqueeze(-1)
    accept = (p[:, :-1].gather(-1, drafted) / q.gather(-1, drafted)).clamp_max(1)[..., 0]
    ones = torch.ones_like(accept[:, :1])
    reach = torch.cat([ones, accept.cumprod(-1)], dim=1)  # [n, γ+1]: P(τ >= i)
    tau_law = reach * torch.cat([1 - accept, ones], dim=1)  # [n, γ+1]
    return tau_law.unsqueeze(-1) * _emitted_rows(p, q, torch.ones_like(reach))


def _block_law(
    x: torch.Tensor,  # [n, γ] int64
    q: torch.Tensor,  # [n, γ, V] float64 (gbv: q̃)
    p: torch.Tensor,  # [n, γ+1, V] float64
    q_x: torch.Tensor | None,  # [n, γ]: q(x_i) as the verifier reads it (gbv), else gathered
    backend: Backend,  # a torch one (float64 rows: never numba's or a fused kernel's)
) -> torch.Tensor:
    """Block verification: level i passes with h_i (h_0 = 1, h_γ = p_γ), each on its own η,
    and τ is the highest passing level, so P(τ = i) = h_i Π_{j > i} (1 - h_j); the emitted
    y ~ (p_τ p - q)_+ at τ (the bonus: p). [n, γ+1, V]"""
    gamma = x.shape[1]
    drafted = x.unsqueeze(-1)
    q_x = q.gather(-1, drafted)[..., 0] if q_x is None else q_x.double()
    pi = running_products(p[:, :gamma].gather(-1, drafted)[..., 0], q_x, torch.float64)
    mass = residual_mass(backend, p[:, 1:gamma], q[:, 1:], pi[:, :-1])  # [n, γ-1]
    ones = torch.ones_like(pi[:, :1])
    h = torch.cat([ones, level_probs(mass, pi[:, :-1]), pi[:, -1:]], dim=1)  # [n, γ+1]
    fail_above = (1 - h[:, 1:]).flip(1).cumprod(1).flip(1)  # [n, γ]: Π_{j > i} (1 - h_j)
    tau_law = h * torch.cat([fail_above, ones], dim=1)  # [n, γ+1]
    return tau_law.unsqueeze(-1) * _emitted_rows(p, q, torch.cat([ones, pi], dim=1))


def _emitted_rows(
    p: torch.Tensor,  # [n, γ+1, V]
    q: torch.Tensor,  # [n, γ, V]
    scale: torch.Tensor,  # [n, γ+1]: what p is scaled by at each τ (block: p_τ; token: 1)
) -> torch.Tensor:
    """The law of y at each τ: (scale p - q)_+ normalised, q = 0 after the whole path (the
    bonus), p itself where nothing is left (a branch of probability 0, spec §11). [n, γ+1, V]"""
    q_rows = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)
    rows = positive_part_or(scale.unsqueeze(-1) * p - q_rows, p)
    return rows / rows.sum(-1, keepdim=True)


def law_mass(
    law: torch.Tensor,  # [n, γ+1, V]: outcome_law's
    x: torch.Tensor,  # [n, γ] int64: the path it is on
    prefixes: list[list[tuple[int, ...]]],  # per request, prepared outcomes (predict_outcomes)
) -> list[float]:
    """The law's mass on each request's prepared prefixes: its chance of a hit."""
    rows = x.tolist()
    return [
        sum(
            float(law[b, len(o) - 1, o[-1]])
            for o in dict.fromkeys(prepared)
            if len(o) <= len(rows[b]) + 1 and list(o[:-1]) == rows[b][: len(o) - 1]
        )
        for b, prepared in enumerate(prefixes)
    ]
