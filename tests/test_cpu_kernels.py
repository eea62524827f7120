"""The fused CPU passes of service/verification/cpu_kernels.py (numba) against torch ops.

The skew repeats the torch ops' float32 steps, so it is bit for bit the same wherever torch's
CPU addcmul is one fused multiply-add (as its compiler builds it here), and within an ulp of
the power sum's steps elsewhere. C at the drafted tokens sums in another order than
``torch.sum``: the same float64 total up to its last bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.verification import cpu_kernels, gbv

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


def skewed(q: torch.Tensor, p: torch.Tensor, lam: torch.Tensor, k: int) -> torch.Tensor:
    """q̃ of each row [n, V] by the kernels' steps, as GBV's loops take them: the sort words,
    numpy's sort, then the skew walk up the order."""
    ids, _ = cpu_kernels._ranked(p.numpy(), q.numpy())
    out = np.empty(q.shape, np.float32)
    for r in range(q.shape[0]):
        cpu_kernels._skew_walk(q[r].numpy(), ids[r], float(lam[r]), k, out[r])
    return torch.from_numpy(out)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_skewed_rows_equal_the_torch_ops(vocab, ties, k):
    """q̃ of whole rows: sort words, sort and walk against gbv's ranking, running sum and
    skew as torch ops; λ = 0 (the root) and λ up to 50."""
    p, q = rows(vocab, seed=vocab + k, ties=ties)
    lam = torch.linspace(0, 50, 8, dtype=torch.float64)
    key = gbv.ranking_key(p, q)
    want = gbv.skewed_probs(q, gbv.mass_ranked_below(key, q), lam, k)
    got = skewed(q, p, lam, k)
    assert got.dtype == torch.float32 and got.shape == q.shape
    if addcmul_is_fused():
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=4 * k * 2**-24, atol=0)


def mass_below(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The kernel's C(x[r]) in each row r of p, q [n, V]: [n] float64."""
    rows = zip(p.numpy(), q.numpy(), x.numpy(), strict=True)
    return torch.tensor([cpu_kernels._mass_below(*row) for row in rows], dtype=torch.float64)


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


def test_gbv_takes_the_kernels_only_for_float32_cpu_rows():
    q = torch.rand(2, 3)
    assert cpu_kernels.applies(q, q)
    assert not cpu_kernels.applies(q, q.double())
    assert not cpu_kernels.applies(q.bfloat16())
    assert not cpu_kernels.applies(q.t())  # V must be contiguous


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("ties", [False, True])
def test_kseq_rho_equals_the_torch_search(vocab, ties, monkeypatch):
    """SpecTr's ρ* and β(ρ*) from the kernel against top_down.kseq_rho_all's torch ops, for
    n = 2..5 candidates: the same prefix sums and probes; ρ* equal up to the last bits of
    (1 - β)^n, which torch's vectorised pow and the compiled one may round differently."""
    from service.verification import top_down

    p, q = rows(vocab, seed=vocab + 7, ties=ties)
    nf = torch.arange(8).remainder(4).add(2).double()
    rho, beta = cpu_kernels.kseq_rho(p, q, nf, *top_down.SEARCH_NARROW)
    monkeypatch.setattr(cpu_kernels, "applies", lambda *rows: False)
    want_rho, want_beta = top_down.kseq_rho_all(p, q, nf)
    torch.testing.assert_close(rho, want_rho, rtol=1e-12, atol=0)
    torch.testing.assert_close(beta, want_beta, rtol=1e-12, atol=0)
    assert (rho > 1).any() and (rho >= 1).all() and (rho <= nf).all()


def test_draft_support_equals_the_torch_ops(monkeypatch):
    """common.draft_support through the kernel against its torch ops: a sparse draft (the
    union of the rows' supports), a dense one, and one whose first row alone is sparse."""
    from service.verification import common

    gen = torch.Generator().manual_seed(0)
    q = torch.rand(6, 1000, generator=gen)
    sparse = q * (torch.rand(6, 1000, generator=gen) < 0.05)
    first_sparse = q.clone()
    first_sparse[0] = sparse[0]
    cases = [sparse, q, first_sparse, sparse.view(2, 3, 1000)]
    got = [common.draft_support(t) for t in cases]
    monkeypatch.setattr(cpu_kernels, "applies", lambda *rows: False)
    want = [common.draft_support(t) for t in cases]
    assert want[0] is not None and want[1] is None and want[2] is None
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
