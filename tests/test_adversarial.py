"""Adversarial narrow-vocabulary case: the draft is the softmax of the NEGATED target logits.

V = 16; the target's logits are seeded Gaussians (σ · N(0, 1)), one row per previous token
(a Markov chain, so the conditionals depend on the context); the draft after the same context is
softmax(-logits): it proposes exactly the tokens the target likes least. Σ min(p, q) is ~0.33
at σ = 1 and ~0.08 at σ = 2, so nearly every iteration ends in the residual ("recovered")
branch, whose exact form is what this stresses, with the drafted tokens' p/q ratios spanning
several orders of magnitude.

What is tested, and why it is sound. The per-iteration conditional law of "the token at emitted
position i given that the iteration emitted >= i+1 tokens" is NOT the target's law (acceptance
depends on the token; e.g. token verification keeps a drafted token more often when p/q is
large), so a per-position test inside one iteration would be wrong. Losslessness is a statement
about the generated sequence: over the whole outer loop, generated token number i (i = 1..L) has
the target's exact marginal P(x_i = v) = Σ_{x^{i-1}} p(x^{i-1}) p(v | x^{i-1}), and the first
tokens have the target's exact joint law. Both are computed exactly by enumerating the V^L
prefixes of the Markov tables (harness.WindowModel.exact_law). So per trial the harness decode
loop runs until >= L tokens are generated, and we test (a) the marginal law at every position
1..L (16 cells each: high power against a bias at one position) and (b) the joint law of the
first two tokens (256 cells). With γ = 3 and L = 4, positions 2..4 are produced by accepted,
recovered and bonus tokens of the first iteration as well as by later iterations.

Power: at N = 50k a cell of probability 0.1 has standard error 1.3e-3; a bias of 0.01 in one
marginal cell gives a noncentrality λ = N Δ² / p = 50 on <= 15 dof (critical value ~42 at
ALPHA = 1e-4), rejected with probability ~0.9; at N = 200k (slow) the same holds for a bias of
0.005. The mutant test below (token verification recovering from the plain target row instead
of the residual, a classic lossy shortcut) is rejected with p < 1e-100.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from harness import (
    ALPHA,
    TableModel,
    WindowModel,
    chi_square,
    counts_of,
    decode_loop,
    draft_block,
    law_dict,
    method_step,
    random_rows,
    sequence_codes,
)

from blockspec.verification import METHODS, VERIFIERS, Backend, common, gbv, top_down, verify
from blockspec.verification import token as token_module

V = 16
GAMMA = 3
LENGTH = 4
N_DEFAULT = 50_000
N_SLOW = 200_000


def adversarial_pair(sigma: float, seed: int = 2024) -> tuple[WindowModel, WindowModel]:
    """Target softmax(σ z_c), draft softmax(-σ z_c), z_c ~ N(0, 1)^V seeded per context c."""
    target = WindowModel(TableModel(V, 1, random_rows(V, seed, scale=sigma)))
    draft = WindowModel(TableModel(V, 1, random_rows(V, seed, scale=-sigma)))
    return target, draft


def position_pvalues(seq: torch.Tensor, target: WindowModel) -> dict[str, float]:
    """p-values of (a) the marginal law of every generated position and (b) the joint law of the
    first two generated tokens, against the target's exact laws."""
    n, length = seq.shape
    joint = target.exact_law(length).view([V] * length)
    out = {}
    for i in range(length):
        marginal = joint.sum(dim=[j for j in range(length) if j != i])
        observed = Counter(dict(enumerate(torch.bincount(seq[:, i], minlength=V).tolist())))
        out[f"position {i + 1}"] = chi_square(observed, law_dict(marginal), n)[2]
    first_two = joint.sum(dim=list(range(2, length))).reshape(-1)
    out["first two"] = chi_square(counts_of(sequence_codes(seq[:, :2], V)), law_dict(first_two), n)[
        2
    ]
    return out


def run(step, k: int, n: int, sigma: float, seed: int) -> dict[str, float]:
    target, draft = adversarial_pair(sigma)
    seq = decode_loop(step, target, draft, n, k, GAMMA, LENGTH, seed, dtype=torch.float32)
    return position_pvalues(seq, target)


def default_k(method: str) -> int:
    return 1 if VERIFIERS[method].single_path else 2


@pytest.mark.parametrize("method", METHODS)
def test_adversarial_positions_default(method):
    pvalues = run(
        method_step(method), default_k(method), N_DEFAULT, 1.0, seed=METHODS.index(method)
    )
    bad = {name: p for name, p in pvalues.items() if p <= ALPHA}
    assert not bad, f"{method}: rejected {bad}"


def slow_cases():
    for method in METHODS:
        ks = (1,) if VERIFIERS[method].single_path else (1, 2, 3)
        for k in ks:
            for sigma in (1.0, 2.0):
                yield pytest.param(method, k, sigma, id=f"{method}-K{k}-sigma{sigma:g}")


@pytest.mark.slow
@pytest.mark.parametrize(("method", "k", "sigma"), list(slow_cases()))
def test_adversarial_positions_slow(method, k, sigma):
    seed = 100 + 7 * METHODS.index(method) + k + int(10 * sigma)
    pvalues = run(method_step(method), k, N_SLOW, sigma, seed)
    bad = {name: p for name, p in pvalues.items() if p <= ALPHA}
    assert not bad, f"{method} K={k} σ={sigma}: rejected {bad}"


def reduced_head_pair(keep: int = 6, seed: int = 2024) -> tuple[WindowModel, WindowModel]:
    """The adversarial pair with a draft that can only say `keep` of the V tokens, the same
    ones after every context (a reduced head, as the default pair's draft has): q = 0 on the
    rest, which the target likes most. GBV then ranks only the draft's support."""
    support = np.random.default_rng(seed).permutation(V)[:keep]
    negated = random_rows(V, seed, scale=-1.0)

    def head_only(prefix):
        row = np.zeros(V)
        row[support] = np.asarray(negated(prefix))[support]
        return list(row / row.sum())

    target = WindowModel(TableModel(V, 1, random_rows(V, seed)))
    return target, WindowModel(TableModel(V, 1, head_only))


@pytest.mark.parametrize("method", ["gbv", "spectr", "traversal"])
def test_reduced_draft_head_positions(method):
    target, draft = reduced_head_pair()
    seed = 500 + METHODS.index(method)
    seq = decode_loop(method_step(method), target, draft, N_DEFAULT, 3, GAMMA, LENGTH, seed)
    bad = {name: p for name, p in position_pvalues(seq, target).items() if p <= ALPHA}
    assert not bad, f"{method}: rejected {bad}"


def test_ranking_on_a_small_draft_support_is_exact(monkeypatch):
    """GBV and SpecTr's ρ* rank tokens by p/q; on a draft support of a quarter of V they rank
    only those columns. GBV's rows q̃, SpecTr's (ρ*, β) and both methods' seeded outputs equal
    the whole-vocabulary computation bit for bit (tied ratios included: the support keeps the
    ids' order, which breaks ties)."""
    g = torch.Generator().manual_seed(3)
    B, K, gamma, vocab = 6, 3, 4, 1000
    compact = common.SUPPORT_SHARE
    for tied in (False, True):
        logits = torch.randn(B, K, gamma + 1, vocab, generator=g) * 3
        if tied:
            logits = logits.round().clamp(-1, 1)
        logits[:, 1:, 0] = logits[:, :1, 0]
        off = torch.full((vocab,), -torch.inf)
        off[torch.randperm(vocab, generator=g)[: vocab // 4]] = 0
        q = (logits[:, :, :gamma] + torch.randn(B, K, gamma, vocab, generator=g) + off).softmax(-1)
        p = logits.softmax(-1)
        tokens = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(B, K, gamma)
        x, rows_q, rows_p = tokens[:, 0], q[:, 0], p[:, 0]
        runs = []
        for share in (compact, -1.0):  # -1: never compact
            monkeypatch.setattr(common, "SUPPORT_SHARE", share)
            numba = Backend.NUMBA  # float32 CPU rows: verify's backend
            assert (common.draft_support(rows_q, numba) is not None) == (share == compact)
            run = [*gbv.skewed_draft(x, rows_q, rows_p, K, numba)]
            run += top_down.kseq_rho(rows_p[:, 0], rows_q[:, 0], torch.full((B,), K), numba)
            for method in ("gbv", "spectr"):
                out = verify(method, tokens, q, p, generator=torch.Generator().manual_seed(9))
                run += [out.tokens, out.path]
            runs.append(run)
        for a, b in zip(*runs, strict=True):
            assert torch.equal(a, b)
    # An unvalidated call whose drafted token has q = 0 (an inconsistent pipeline) ranks the
    # whole vocabulary, as before, rather than a neighbouring column of the support.
    tokens[0, 0, 0] = int((q[0, 0, 0] == 0).nonzero()[0])
    runs = []
    for share in (compact, -1.0):
        monkeypatch.setattr(common, "SUPPORT_SHARE", share)
        out = verify("gbv", tokens, q, p, torch.Generator().manual_seed(9), validate=False)
        q_tilde = gbv.skewed_draft(tokens[:, 0], q[:, 0], p[:, 0], K, Backend.NUMBA)
        runs.append((*q_tilde, out.tokens, out.path))
    for a, b in zip(*runs, strict=True):  # q̃ is NaN past the q = 0 token, on both paths
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_power_residual_shortcut_is_rejected(monkeypatch):
    """Token verification that recovers from p instead of norm((p - q)_+) is lossy; at N = 50k
    the position tests must reject it (it over-weights the tokens the draft likes)."""

    def plain_target(weights, fallback):
        return fallback  # token.py calls positive_part_or(p - q, p): return p itself

    monkeypatch.setattr(token_module, "positive_part_or", plain_target)
    pvalues = run(method_step("token"), 1, N_DEFAULT, 1.0, seed=77)
    assert min(pvalues.values()) < 1e-12, pvalues


def test_power_positions_within_one_iteration_are_not_target_marginals():
    """Why the per-position test is done at the loop level: within ONE iteration, the token at
    emitted position 2 given >= 2 emitted tokens does not follow the target's position-2 marginal
    (acceptance depends on the token). This documents the trap: the naive test rejects a correct
    method (block verification) on this adversarial pair."""
    target, draft = adversarial_pair(1.0)
    gen = torch.Generator().manual_seed(5)
    n = N_DEFAULT

    seq = torch.zeros(n, GAMMA + 1, dtype=torch.int64)
    x, q, p = draft_block(target, draft, seq, torch.zeros(n, dtype=torch.int64), 1, GAMMA, gen)
    out = verify("block", x, q.float(), p.float(), gen)
    reached = out.num_tokens >= 2
    marginal = target.exact_law(2).view(V, V).sum(0)
    observed = Counter(
        dict(enumerate(torch.bincount(out.tokens[reached, 1], minlength=V).tolist()))
    )
    assert chi_square(observed, law_dict(marginal), int(reached.sum()))[2] < 1e-12
