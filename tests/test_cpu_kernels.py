"""The fused CPU passes of the verifiers' numba loops (gbv/loops.py, top_down/loops.py and
the shared steps of verification/cpu_kernels.py) against torch ops.

The skew repeats the torch ops' float32 steps, so it is bit for bit the same wherever torch's
CPU addcmul is one fused multiply-add (as its compiler builds it here), and within an ulp of
the power sum's steps elsewhere. C at the drafted tokens sums in another order than
``torch.sum``: the same float64 total up to its last bits.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from blockspec.verification import Backend, block, choose_backend, gbv
from blockspec.verification.gbv import loops as gbv_loops
from blockspec.verification.top_down import loops as top_down_loops

VOCABS = [7, 300, 5003]  # below and above one vector of lanes, and no multiple of one


def addcmul_is_fused() -> bool:
    """Whether torch's CPU addcmul rounds t + a·b once (as the kernel's FMA does)."""
    gen = torch.Generator().manual_seed(0)
    a, b, t = (torch.rand(4096, generator=gen) for _ in range(3))
    once = (a.double() * b.double() + t.double()).float()  # a·b exact in float64
    return torch.equal(torch.addcmul(t, a, b), once)


def rows(vocab: int, seed: int, ties: bool):
    """p, q [8, V] float32. With ties: p/q quantised to 1..3, a row with p = q (every ratio
    equal: the order is the ids'), a row with p = 0 on half the tokens (ratio 0) and one with
    q = 0 on every third (ratio +inf, and 0/0 = +inf where p is 0 too)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(8, vocab, generator=gen, dtype=torch.float64).mul(3).softmax(-1)
    p = torch.randn(8, vocab, generator=gen, dtype=torch.float64).mul(3).softmax(-1)
    if ties:
        p = torch.randint(1, 4, q.shape, generator=gen) * q
        p[0] = q[0]
        p[1, : vocab // 2] = 0
        q[2, ::3] = 0
        p[2, ::6] = 0
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    return p.float(), q.float()


def ranked_rows(p, q, lam, k, pi) -> torch.Tensor:
    """q̃ of each row [n, V] at a level of running product pi [n] and prefix λ [n], by GBV's
    loop: the dead prefix, the live tokens' sort words sorted, the walk up them. +inf at the
    dead tokens."""
    ids = np.arange(q.shape[1])
    out = np.zeros(q.shape, np.float32)
    words = np.empty(q.shape[1], np.int64)
    for r in range(q.shape[0]):
        p_r, q_r, lam_r = p[r].numpy(), q[r].numpy(), float(lam[r])
        kappa, dead, _ = gbv_loops._dead_prefix(p_r, q_r, ids, lam_r, k, np.float32(pi[r]))
        count = gbv_loops._live_words(p_r, q_r, ids, kappa, words, out[r])
        gbv_loops._live_walk(q_r, np.sort(words[:count]), dead, lam_r, k, out[r])
    return torch.from_numpy(out)


# λ from the root's 0 up, and the running product at the level from 1 down.
LEVEL_LAMBDAS = [0, 0.5, 2, 10, 50, 1e3, 1e5, 1e7]
LEVEL_PRODUCTS = [1, 0.9, 0.7, 0.5, 1, 0.3, 0.2, 0.05]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_ranked_rows_give_the_torch_ops_residuals(vocab, ties, k):
    """q̃ of rows at a level against gbv's ranking, running sum and skew as torch ops: equal at
    every live token, and every dead one (+inf, never ranked) had a residual (p_i p - q̃)_+ of
    0 there, so the residual rows are equal. Tokens are dead in most rows past λ = 2."""
    p, q = rows(vocab, seed=vocab + k, ties=ties)
    lam = torch.tensor(LEVEL_LAMBDAS, dtype=torch.float64)
    pi = torch.tensor(LEVEL_PRODUCTS)
    want = gbv.skewed_probs(q, gbv.mass_ranked_below(gbv.ranking_key(p, q), q), lam, k)
    got = ranked_rows(p, q, lam, k, pi)

    def residual(q_tilde):
        return torch.addcmul(q_tilde, p, pi.unsqueeze(-1), value=-1).clamp_max(0)

    dead = got.isinf()
    assert torch.equal(residual(got), residual(want))
    if addcmul_is_fused():
        assert torch.equal(got[~dead], want[~dead])
    else:
        torch.testing.assert_close(got[~dead], want[~dead], rtol=4 * k * 2**-24, atol=0)
    assert dead[lam > 2].any(-1).float().mean() >= 0.75


def mass_below(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The kernel's C(x[r]) in each row r of p, q [n, V]: [n] float64."""
    rows = zip(p.numpy(), q.numpy(), x.numpy(), strict=True)
    return torch.tensor([gbv_loops._mass_below(*row) for row in rows], dtype=torch.float64)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("ties", [False, True])
def test_mass_below_equals_the_ranked_running_sum(vocab, ties):
    """C(x) against the running sum of the rows sorted by (p/q, id) at x, in float64, ties by
    id included."""
    p, q = rows(vocab, seed=vocab, ties=ties)
    gen = torch.Generator().manual_seed(1)
    x = torch.multinomial(q.double(), 1, generator=gen).squeeze(-1)
    ranked = gbv.mass_ranked_below(gbv.ranking_key(p, q), q.double())  # [8, V] float64
    want = ranked.gather(-1, x.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(mass_below(p, q, x), want, rtol=1e-12, atol=1e-14)


def test_mass_below_a_drafted_token_of_ratio_0_over_0():
    """An unvalidated call can draft a token with p = q = 0: its key is +inf (sorting's), so
    every token of finite ratio ranks below it, not none."""
    p, q = rows(300, seed=3, ties=True)  # row 2: p = q = 0 on tokens 0, 6, 12, ...
    ranked = gbv.mass_ranked_below(gbv.ranking_key(p, q), q.double())
    got = mass_below(p[2:3], q[2:3], torch.tensor([6]))
    torch.testing.assert_close(got[0], ranked[2, 6], rtol=1e-12, atol=1e-14)
    assert got[0] > 0.9


def test_the_kernels_run_only_for_float32_cpu_rows():
    q = torch.rand(2, 3)
    assert choose_backend(q, q) is Backend.NUMBA
    assert choose_backend(q, q.double()) is Backend.TORCH_HOST
    assert choose_backend(q.bfloat16(), q.bfloat16()) is Backend.TORCH_HOST
    assert choose_backend(q.t(), q.t()) is Backend.TORCH_HOST  # V must be contiguous


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("ties", [False, True])
def test_kseq_rho_equals_the_torch_search(vocab, ties):
    """SpecTr's ρ* and β(ρ*) from the kernel against top_down.kseq_rho_all's torch ops, for
    n = 2..5 candidates: the same prefix sums and probes; ρ* equal up to the last bits of
    (1 - β)^n, which torch's vectorised pow and the compiled one may round differently."""
    from blockspec.verification import top_down

    p, q = rows(vocab, seed=vocab + 7, ties=ties)
    nf = torch.arange(8).remainder(4).add(2).double()
    rho, beta = top_down_loops.kseq_rho(p, q, nf, *top_down.SEARCH_NARROW)
    want_rho, want_beta = top_down.kseq_rho_all(p, q, nf, Backend.TORCH_HOST)
    torch.testing.assert_close(rho, want_rho, rtol=1e-12, atol=0)
    torch.testing.assert_close(beta, want_beta, rtol=1e-12, atol=0)
    assert (rho > 1).any() and (rho >= 1).all() and (rho <= nf).all()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_kseq_rho_with_ratios_at_the_search_bounds(n):
    """The kernel ranks only the ratios in [1, n) and sums the rest apart: rows whose ratios
    are exactly 1 (a probe at ρ = 1 counts them above it), exactly n (above every probe) or
    0, against the torch search over every token."""
    from blockspec.verification import top_down

    vocab = 4096
    q = torch.full((3, vocab), 1 / vocab)
    p = torch.zeros(3, vocab)
    p[0, : vocab // n] = n / vocab  # ratio n, or 0
    p[1, : vocab // 2] = 1 / vocab  # ratio 1, n, or 0
    p[1, vocab // 2 : vocab // 2 + vocab // (2 * n)] = n / vocab
    p[2] = torch.linspace(0, 2 / vocab, vocab)  # every ratio in [0, 2], 1 among them
    p = p / p.sum(-1, keepdim=True)
    nf = torch.full((3,), float(n), dtype=torch.float64)
    rho, beta = top_down_loops.kseq_rho(p, q, nf, *top_down.SEARCH_NARROW)
    want_rho, want_beta = top_down.kseq_rho_all(p, q, nf, Backend.TORCH_HOST)
    torch.testing.assert_close(rho, want_rho, rtol=1e-12, atol=0)
    torch.testing.assert_close(beta, want_beta, rtol=1e-12, atol=0)
    assert (rho > 1).all()


def test_draft_support_equals_the_torch_ops():
    """common.draft_support through the kernel against its torch ops: a sparse draft (the
    union of the rows' supports), a dense one, and one whose first row alone is sparse."""
    from blockspec.verification import common

    gen = torch.Generator().manual_seed(0)
    q = torch.rand(6, 1000, generator=gen)
    sparse = q * (torch.rand(6, 1000, generator=gen) < 0.05)
    first_sparse = q.clone()
    first_sparse[0] = sparse[0]
    cases = [sparse, q, first_sparse, sparse.view(2, 3, 1000)]
    got = [common.draft_support(t, Backend.NUMBA) for t in cases]
    want = [common.draft_support(t, Backend.TORCH_HOST) for t in cases]
    assert want[0] is not None and want[1] is None and want[2] is None
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def drafted_paths(vocab: int, n: int, gamma: int, k: int, seed: int):
    """n paths of γ rows, the draft near the target, the tokens drafted from it: C, q and p
    at the tokens [n, γ] and the exact running products (gbv's torch ops)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, gamma, vocab, generator=gen) * 3
    p = logits.softmax(-1)
    q = (logits + torch.randn(n, gamma, vocab, generator=gen) * 0.7).softmax(-1)
    x = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(n, gamma)
    below_x, q_x, p_x = gbv._path_values(q, p, x, Backend.TORCH_HOST)
    _, q_tilde_x = gbv._skew_at_path(below_x, q_x, k)
    return below_x, q_x, p_x, block.running_products(p_x, q_tilde_x, torch.float32)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_highest_reachable_level_is_never_below_the_exact_scans(k):
    """_highest_reachable, from C at the path's first token alone, against levels_top_down's
    first level from the exact running products (γ if η_γ < p_γ, else the highest i with
    η_i < p_i·slack): never below it (the levels it rules out are ones the exact scan skips),
    equal in most draws (~0.9), and below γ in about half (~0.6: C need not be summed above
    it; these paths pass level γ in a third of the draws)."""
    gamma = 6
    below_x, q_x, p_x, pi = drafted_paths(300, 64, gamma, k, seed=k)
    slack = block.reach_slack(torch.float32)
    gen = torch.Generator().manual_seed(10 + k)
    eta = torch.rand(20, 64, gamma, generator=gen)
    reach = eta.double() < pi.double() * slack  # [draws, n, γ]: level i + 1 can pass
    levels = torch.arange(1, gamma + 1)
    exact = torch.where(reach[..., :-1], levels[:-1], 0).amax(-1)
    exact = torch.where(eta[..., -1] < pi[..., -1], gamma, exact)
    got = torch.tensor(
        [
            [
                gbv_loops._highest_reachable(
                    p_x[r].numpy(),
                    q_x[r].numpy(),
                    np.float32(below_x[r, 0]),
                    k,
                    eta[d, r].numpy(),
                    slack,
                )
                for r in range(64)
            ]
            for d in range(20)
        ]
    )
    assert (got >= exact).all()
    assert (got == exact).float().mean() >= 0.8
    assert (got < gamma).float().mean() >= 0.4


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("k", [2, 3, 4])
def test_levels_failed_unranked_fail_the_exact_test(vocab, k):
    """_fails_unranked against the exact test η < h = R / (R + 1 - p_i) from q̃ as torch ops,
    for rows at a level and η on a grid: a level it fails fails exactly, and past λ = 2 it
    fails most of those that fail with h well below η."""
    p, q = rows(vocab, seed=vocab + k, ties=False)
    lam = torch.tensor(LEVEL_LAMBDAS, dtype=torch.float64)
    pi = torch.tensor(LEVEL_PRODUCTS)
    q_tilde = gbv.skewed_probs(q, gbv.mass_ranked_below(gbv.ranking_key(p, q), q), lam, k)
    mass = block.residual_mass(Backend.TORCH_HOST, p, q_tilde, pi)
    h = mass / (mass + 1 - pi)  # [8] float32, as the loop's test
    eta = torch.linspace(0, 1, 201)
    ids = np.arange(vocab)
    for r in range(8):
        p_r, q_r, pi_r = p[r].numpy(), q[r].numpy(), np.float32(pi[r])
        kappa, _, floor = gbv_loops._dead_prefix(p_r, q_r, ids, float(lam[r]), k, pi_r)
        fails = torch.tensor(
            [gbv_loops._fails_unranked(p_r, q_r, kappa, floor, pi_r, np.float32(e)) for e in eta]
        )
        assert not (fails & (eta < h[r])).any()
        clearly = eta > h[r] * 1.05 + 1e-3
        if lam[r] > 2 and pi[r] < 0.99 and clearly.any():
            assert fails[clearly].float().mean() >= 0.9, (r, float(h[r]))


def test_no_level_is_failed_unranked_where_its_test_cancels():
    """Rows that sum to 1 - 3e-4 (within ROW_SUM_TOL) and whose residual is one token's (q ~ 0
    there), at p_i a few ulps below 1: R ~ 1e-6 and the float32 test's m + 1 - p_i cancels,
    so h is off by percents and _fails_unranked claims nothing (without that guard it failed
    levels that pass on these rows)."""
    gen = np.random.default_rng(0)
    vocab, k, lam = 64, 2, 1e9
    for _ in range(40):
        q = gen.dirichlet(np.ones(vocab)).astype(np.float32)
        p = q * np.float32(1 - 3e-4)
        p[0], q[0] = 10 ** gen.uniform(-7, -5), 1e-12
        pi = np.float32(1 - gen.integers(1, 40) * 2**-24)
        pt, qt = torch.from_numpy(p)[None], torch.from_numpy(q)[None]
        lam_t = torch.tensor([lam], dtype=torch.float64)
        q_tilde = gbv.skewed_probs(qt, gbv.mass_ranked_below(gbv.ranking_key(pt, qt), qt), lam_t, k)
        mass = block.residual_mass(Backend.TORCH_HOST, pt, q_tilde, torch.tensor([pi]))
        h = float(mass / (mass + 1 - torch.tensor(pi)))
        kappa, _, floor = gbv_loops._dead_prefix(p, q, np.arange(vocab), lam, k, pi)
        for eta in np.linspace(0.8 * h, min(1.2 * h, 1), 200).astype(np.float32):
            assert not (gbv_loops._fails_unranked(p, q, kappa, floor, pi, eta) and eta < h)


@pytest.mark.parametrize("vocab", VOCABS)
def test_kseq_residual_draws_equal_the_torch_ops(vocab):
    """top_down_loops.kseq_residual_tokens against spectr_rule's residual as torch ops,
    y ~ (p - min(q, p/ρ)·scale)_+, for ρ from 1 to 3 and 40 uniforms a row; row 0 has p = q at
    ρ = scale = 1, nothing left: p is drawn instead."""
    from blockspec.verification.common import positive_part_or
    from blockspec.verification.tensors import sample_from_weights

    p, q = rows(vocab, seed=vocab + 11, ties=False)
    p[0] = q[0]
    rho = torch.tensor([1, 1.2, 1.5, 2, 2.5, 3, 1.1, 1.9])
    scale = torch.tensor([1, 0.9, 0.8, 0.6, 0.5, 0.4, 0.95, 0.7])
    every = torch.arange(8)
    for u in torch.rand(40, 8, generator=torch.Generator().manual_seed(vocab), dtype=torch.float64):
        got = top_down_loops.kseq_residual_tokens(p, q, every, rho, scale, u)
        overlap = torch.minimum(q, p / rho[:, None])
        want = sample_from_weights(positive_part_or(p - overlap * scale[:, None], p), u)
        assert torch.equal(got, want)
    odd = torch.tensor([1, 5, 7])
    got = top_down_loops.kseq_residual_tokens(p, q, odd, rho, scale, u)
    assert torch.equal(got, want[odd])


LOADED_KERNELS = """
import importlib, pkgutil, sys, torch
from numba.core.registry import CPUDispatcher
import blockspec.verification as V

def loaded():
    names = set()
    for info in pkgutil.walk_packages(V.__path__, "blockspec.verification."):
        for name, obj in vars(importlib.import_module(info.name)).items():
            if isinstance(obj, CPUDispatcher) and obj.signatures:
                names.add(f"{info.name}.{name}")
    return names

V.load_cpu_kernels(*map(int, sys.argv[1:]))
before = loaded()
gen = torch.Generator().manual_seed(0)
B, K, G, W = 6, 3, 4, 300  # a batch unlike the warm-up's
for method, verifier in V.VERIFIERS.items():
    k = 1 if verifier.single_path else K
    q = torch.randn(B, k, G, W, generator=gen).mul(3).softmax(-1)
    p = torch.randn(B, k, G + 1, W, generator=gen).mul(3).softmax(-1)
    q[:, 1:, 0], p[:, 1:, 0] = q[:, :1, 0], p[:, :1, 0]  # one context: one first row
    x = torch.multinomial(q.reshape(-1, W), 1, generator=gen).view(B, k, G)
    x[:, :, 0] = torch.randperm(W, generator=gen)[:k]  # distinct paths from their first token
    carry = None
    for step in range(6):
        keys = torch.tensor([[7, step]] * B)
        carry = V.verify(method, x, q, p, V.CounterDraws(keys), carry=carry).carry
print(sorted(loaded() - before), len(before))
"""


def test_loading_the_kernels_leaves_no_kernel_for_a_request_to_load():
    """StepRunner loads the verifiers' compiled loops when it is made (a replica, an actor, an
    in-process engine): a process that then verifies every method over several steps, with
    carries, loads no kernel the warm-up did not (one step a method, without carries, does
    not reach the carried records' loop: that is the mutant)."""

    def newly_loaded(*args: str) -> str:
        cmd = [sys.executable, "-c", LOADED_KERNELS, *args]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout

    new, count = newly_loaded().rsplit(" ", 1)
    assert new == "[]" and int(count) >= 9
    assert "_apply_records" in newly_loaded("1")
