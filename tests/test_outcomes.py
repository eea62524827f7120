"""The verification-outcome predictor (workers/outcomes.py): a speculation cache's keys."""

from __future__ import annotations

import torch

from workers.outcomes import actual_outcomes, merged_by_prefix, outcome_scores, predict_outcomes


def rows(n, k, depth, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(n, k, depth, V, generator=g, dtype=torch.float64).softmax(-1)
    x = torch.multinomial(q[:, :, :-1].flatten(0, 2), 1, generator=g).view(n, k, depth - 1)
    return x, q


def test_outcome_scores_are_a_distribution_over_outcomes():
    x, q = rows(3, 2, 5, 7)
    accept = torch.rand(3, 2, 4, dtype=torch.float64)
    scores = outcome_scores(x, q, accept)  # [n, K, γ+1, V]
    torch.testing.assert_close(scores.sum((1, 2, 3)), torch.ones(3, dtype=torch.float64))
    # a rejected token is never the one emitted in its place
    assert (scores[:, :, :4].gather(-1, x[..., None]) == 0).all()


def test_the_likeliest_outcome_by_hand():
    # one path, γ = 1, V = 3: x = 0 drawn from q0 = (.5, .3, .2); after it q1 = (.1, .1, .8)
    x = torch.tensor([[[0]]])
    q = torch.tensor([[[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]]], dtype=torch.float64)
    accept = torch.tensor([[[0.3]]], dtype=torch.float64)
    # rejected: 0.7 x (.6, .4) over tokens 1, 2; accepted: 0.3 x (.1, .1, .8)
    scores = outcome_scores(x, q, accept)[0, 0]
    expected = torch.tensor([[0, 0.42, 0.28], [0.03, 0.03, 0.24]], dtype=torch.float64)
    torch.testing.assert_close(scores, expected)
    assert predict_outcomes(x, q, accept, 1) == [[(1,)]]
    assert predict_outcomes(x, q, accept, 3) == [[(1,), (2,), (0, 2)]]  # likeliest first


def test_actual_outcomes_read_the_chosen_path():
    x = torch.tensor([[[5, 6, 7], [5, 8, 9]], [[1, 2, 3], [4, 4, 4]]])
    tokens = torch.tensor([[5, 8, 11, -1], [4, -1, -1, -1]])
    out = actual_outcomes(x, torch.tensor([2, 0]), torch.tensor([1, 0]), tokens)
    assert out == [(5, 8, 11), (4,)]


def test_paths_sharing_a_prefix_sum_their_outcomes():
    """K = 2 paths from one root share τ = 0; these two share their first token too. Each
    prefix is scored once, with the sum of the paths' estimates (its first path holds it)."""
    x, q = rows(1, 2, 4, 6, seed=3)
    x[0, 1, 0] = x[0, 0, 0]  # both paths start with the same token
    x[0, 1, 1] = (x[0, 0, 1] + 1) % 6  # and part after it
    accept = torch.full((1, 2, 3), 0.4, dtype=torch.float64)
    scores = outcome_scores(x, q, accept)
    merged = merged_by_prefix(x, scores)
    torch.testing.assert_close(merged[0, 0, :2], scores[0, 0, :2] + scores[0, 1, :2])
    assert (merged[0, 1, :2] == 0).all()  # τ = 0 and 1: held by path 0
    torch.testing.assert_close(merged[0, :, 2:], scores[0, :, 2:])  # τ ≥ 2: apart
    torch.testing.assert_close(merged.sum(), scores.sum())
    # 48 outcomes, 12 of them on path 1 repeating path 0's prefixes (τ = 0 and 1): each once
    ranked = predict_outcomes(x, q, accept, 40)[0]
    assert len(ranked) == len(set(ranked)) == 36
    # the likeliest prefix by the summed estimates leads
    best = merged.flatten().argmax()
    path, tau, y = best // 24, (best // 6) % 4, best % 6
    assert ranked[0] == (*x[0, path, :tau].tolist(), int(y))
