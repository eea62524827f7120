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
"""

from __future__ import annotations

import torch


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
