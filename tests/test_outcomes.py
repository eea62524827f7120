"""The verification-outcome predictor (workers/outcomes.py): a speculation cache's keys."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
import torch
from harness import ALPHA, chi_square, load_reference, reference_models, sequences

from blockspec.verification import verify
from blockspec.workers import outcomes
from blockspec.workers.outcomes import (
    actual_outcomes,
    law_mass,
    merged_by_prefix,
    outcome_law,
    outcome_scores,
    predict_outcomes,
)


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


# ---------------------------------------------------------------------------------------------
# The exact outcome law (the ceiling of any predictor's hit rate)
# ---------------------------------------------------------------------------------------------

REFERENCE = load_reference()[1]["numbers"]
LAW_CASES = [("TV", "token", 1), ("BV", "block", 1), ("GBV", "gbv", 1), ("GBV", "gbv", 2)]


def every_draft(instance: str, k: int):
    """Every K-tuple of paths a reference instance's draft can draw: x [N, K, γ], its
    probability [N], q and p along it."""
    target, draft, gamma = reference_models(instance)
    paths = torch.cartesian_prod(*[torch.arange(draft.V)] * (gamma * k)).view(-1, k, gamma)
    q = draft.rows(paths, range(gamma))  # [N, K, γ, V]
    p = target.rows(paths, range(gamma + 1))  # [N, K, γ+1, V]
    prob = q.gather(-1, paths[..., None]).flatten(1).prod(-1)
    drawn = prob > 0  # a draft never proposes a token it gives q = 0 (R3's top-k rows)
    return paths[drawn], prob[drawn], q[drawn], p[drawn]


def output_law(method: str, instance: str, k: int, law_fn=outcome_law) -> dict[str, float]:
    """The one-iteration law of the emitted sequence: outcome_law summed over every draft."""
    x, prob, q, p = every_draft(instance, k)
    path, law = law_fn(method, x, q, p)
    chosen = x[torch.arange(len(x)), path].tolist()
    total = defaultdict(float)
    weights = (prob[:, None, None] * law).tolist()
    for b, rows in enumerate(weights):
        for tau, row in enumerate(rows):
            for y, w in enumerate(row):
                total[",".join(map(str, [*chosen[b][:tau], y]))] += w
    return total


def law_distance(ours: dict[str, float], reference: dict[str, float]) -> float:
    return max(abs(ours.get(s, 0.0) - reference.get(s, 0.0)) for s in {*ours, *reference})


@pytest.mark.parametrize(("spec_name", "method", "k"), LAW_CASES)
@pytest.mark.parametrize("instance", list(REFERENCE))
def test_outcome_law_summed_over_drafts_is_the_reference_law(instance, spec_name, method, k):
    """Exact, no sampling: Σ_x P(x) outcome_law(x) is the committed one-iteration law."""
    reference = REFERENCE[instance][f"K={k}"][spec_name]["output_law"]
    assert law_distance(output_law(method, instance, k), reference) < 1e-9


def test_a_wrong_law_is_told_apart(monkeypatch):
    """The comparison has power: token verification's law is not block verification's, and
    block verification with its running product clipped per factor, Π min(1, p/q) (the lossy
    vLLM-Ascend #7807 bug class), is off the reference on every random instance."""
    reference = REFERENCE["R1-random-s101"]["K=1"]["BV"]["output_law"]
    assert law_distance(output_law("token", "R1-random-s101", 1), reference) > 1e-3

    def per_factor(px, qx, dtype):
        return (px / qx).clamp_max(1).cumprod(-1).to(dtype)

    monkeypatch.setattr(outcomes, "running_products", per_factor)
    for instance in [name for name in REFERENCE if name != "toy"]:
        reference = REFERENCE[instance]["K=1"]["BV"]["output_law"]
        assert law_distance(output_law("block", instance, 1), reference) > 1e-4


def test_outcome_law_is_what_the_verifier_draws():
    """On one draft of the default-like shape (V = 64, γ = 4, K = 2), 100,000 verifier runs
    with fresh uniforms follow the law (chi-square at ALPHA); the path is gbv's."""
    n, k, gamma, V = 100_000, 2, 4, 64
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(1, k, gamma, V, generator=g, dtype=torch.float64) * 2).softmax(-1)
    p = (torch.randn(1, k, gamma + 1, V, generator=g, dtype=torch.float64) * 2).softmax(-1)
    x = q.argmax(-1)  # a likely draft, so deep outcomes get mass
    x[0, 1, 1] = (x[0, 0, 1] + 1) % V
    for method, kk in (("block", 1), ("gbv", 2), ("token", 1)):
        xs, qs, ps = x[:, :kk], q[:, :kk], p[:, :kk]
        path, law = outcome_law(method, xs, qs, ps)
        out = verify(
            method,
            xs.expand(n, -1, -1),
            qs.float().expand(n, -1, -1, -1),
            ps.float().expand(n, -1, -1, -1),
            generator=g,
        )
        assert (out.path == path).all()
        chosen = xs[0, int(path)].tolist()
        expected = {
            ",".join(map(str, [*chosen[:tau], y])): float(law[0, tau, y])
            for tau in range(gamma + 1)
            for y in range(V)
            if law[0, tau, y] > 0
        }
        _, _, pvalue = chi_square(Counter(sequences(out.tokens, out.num_tokens)), expected, n)
        assert pvalue > ALPHA, method


def test_law_mass_reads_only_prefixes_of_the_path():
    law = torch.zeros(1, 3, 5, dtype=torch.float64)
    law[0, 0, 4], law[0, 1, 2], law[0, 2, 0] = 0.5, 0.3, 0.2
    x = torch.tensor([[1, 3]])
    # (4,) τ = 0; (1, 2) τ = 1 on the path; (2, 2) is not the path's; (1, 3, 0) the bonus
    assert law_mass(law, x, [[(4,), (2, 2), (1, 2), (1, 3, 0), (4,)]]) == [1.0]
    assert law_mass(law, x, [[(3, 2), (1, 3, 1)]]) == [0.0]
