"""The fused CUDA row passes (service/verification/kernels.py) against float64 torch sums,
and the verifiers' accelerator paths with them against the same paths without them.

On CUDA (scripts/gpu_checks.sh) they run as compiled; without a GPU they run on CPU tensors
under Triton's interpreter (TRITON_INTERPRET=1, which conftest.py sets): the same kernel
code, executed op by op. Skipped where triton is not installed.
"""

from __future__ import annotations

import os

import pytest
import torch

from service.verification import kernels, verify
from tests.test_verify_cost import inputs, same_tokens, take_accelerator_paths

DEVICE = None if kernels._triton() is None else "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs triton")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytestmark = pytest.mark.skip(reason="no GPU, and Triton's interpreter is off (conftest.py)")
# Triton 3.6's interpreter fails on numpy 2.4 ("only 0-dimensional arrays can be converted to
# Python scalars"); 3.9 is the oldest seen to work here.
if DEVICE == "cpu" and tuple(map(int, kernels._triton()[0].__version__.split(".")[:2])) < (3, 9):
    pytestmark = pytest.mark.skip(reason="Triton's interpreter before 3.9 (numpy 2.4)")


def reference(p, q, t, s=None, c=None):
    """The same masses from float64 copies, with torch ops."""
    p, q = p.double(), q.double()
    if c is not None:
        p = p * c.double().unsqueeze(-1)
    e = (p - t.unsqueeze(-1) * q).clamp_min(0)
    if s is not None:
        e = e - s.unsqueeze(-1) * q
    return e.clamp_min(0).sum(-1), (-e).clamp_min(0).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "lead,vocab", [((), 2048), ((3,), 5000), ((2, 3), 4097), ((2, 2, 3), 100), ((4, 1, 2), 9000)]
)
@pytest.mark.parametrize("with_s", [False, True])
def test_row_masses_match_float64_sums(dtype, lead, vocab, with_s):
    """Rows cut out of larger tensors (strided leading dims, offset columns), every dtype."""
    gen = torch.Generator().manual_seed(vocab)
    big_p = torch.randn(*lead, 2, vocab + 3, generator=gen, dtype=torch.float64).mul(3).softmax(-1)
    big_q = torch.randn(*lead, 2, vocab + 3, generator=gen, dtype=torch.float64).mul(3).softmax(-1)
    p = big_p.to(DEVICE, dtype)[..., 1, 2 : vocab + 2]
    q = big_q.to(DEVICE, dtype)[..., 0, :vocab]
    t = torch.rand(lead, generator=gen, dtype=torch.float64).mul(2).to(DEVICE)
    s = torch.rand(lead, generator=gen, dtype=torch.float64).mul(2).to(DEVICE) if with_s else None
    above, below = kernels.row_masses(p, q, t, s)
    ref_above, ref_below = reference(p, q, t, s)
    assert above.shape == below.shape == lead and above.dtype == torch.float64
    tol = 1e-6 if dtype != torch.bfloat16 else 1e-5  # bf16 inputs are exact in float32
    torch.testing.assert_close(above, ref_above, rtol=0, atol=tol)
    torch.testing.assert_close(below, ref_below, rtol=0, atol=tol)
    if not with_s:
        assert (below == 0).all()


def test_row_masses_scale_the_target_rows():
    """c: block verification's R = Σ(p_i p - q)_+ (t = 1)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(3, 4, 5000, generator=gen).mul(3).softmax(-1).to(DEVICE)
    q = torch.randn(3, 4, 5000, generator=gen).mul(3).softmax(-1).to(DEVICE)
    c = torch.rand(3, 4, generator=gen).to(DEVICE)
    ones = torch.ones(3, 4, dtype=torch.float64, device=DEVICE)
    above, below = kernels.row_masses(p, q, ones, c=c)
    torch.testing.assert_close(above, reference(p, q, ones, c=c)[0], rtol=0, atol=1e-6)
    assert (below == 0).all()


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float64, torch.float32)])
def test_row_masses_read_selected_rows_in_place(dtypes):
    """rows: p[rows], q[rows] without gathering them (traversal's path rows), mixed dtypes."""
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(6, 5, 3000, generator=gen).mul(3).softmax(-1).to(DEVICE, dtypes[0])
    q = torch.randn(6, 6, 3000, generator=gen).mul(3).softmax(-1).to(DEVICE, dtypes[1])[:, :5]
    rows = torch.tensor([4, 0, 4, 2], device=DEVICE)
    c = torch.rand(4, 5, generator=gen, dtype=torch.float64).to(DEVICE)
    ones = torch.ones(4, 5, dtype=torch.float64, device=DEVICE)
    above, below = kernels.row_masses(p, q, ones, c=c, rows=rows)
    ref = reference(p[rows], q[rows], ones, c=c)[0]
    torch.testing.assert_close(above, ref, rtol=0, atol=1e-6)
    assert above.shape == (4, 5) and (below == 0).all()


def skew_inputs(k, dtype, lead=(6,), vocab=5000):
    """Rows q, p [*lead, V] with ties at +inf in the first (q = 0 on 100 tokens), λ [*lead],
    and GBV's rank order of each row."""
    from service.verification.gbv import ranking_key
    from service.verification.sorting import ascending_order

    gen = torch.Generator().manual_seed(k)

    def rows():
        x = torch.randn(*lead, vocab, generator=gen, dtype=torch.float64)
        return x.mul(3).softmax(-1).to(DEVICE, dtype)

    q, p = rows(), rows()
    q.view(-1, vocab)[0, :100] = 0  # ties at +inf, broken by id
    q = q / q.sum(-1, keepdim=True)
    lam = torch.rand(*lead, generator=gen, dtype=torch.float64).mul(5).to(DEVICE)
    key = ranking_key(p, q).view(-1, vocab)
    return q, p, lam, ascending_order(key).view(*lead, vocab), key


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_skewed_rows_are_gbvs_skew_by_id(k, dtype):
    """GBV's q̃ from a walk in rank order, written by id: gbv.skewed_probs on the scattered C;
    and the same rows picked out by flat index."""
    from service.verification.gbv import mass_ranked_below, skewed_probs

    q, _, lam, order, key = skew_inputs(k, dtype, lead=(2, 3))
    want = skewed_probs(q, mass_ranked_below(key, q.view(-1, 5000)).view(q.shape), lam, k)
    got = kernels.skewed_rows(q, order, lam, k)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(got.double().sum(-1), torch.ones_like(lam), rtol=0, atol=1e-5)
    rows = torch.tensor([5, 0, 3], device=DEVICE)
    picked = kernels.skewed_rows(q, order, lam, k, rows=rows)
    torch.testing.assert_close(picked, want.view(-1, 5000)[rows], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_skewed_excess_is_the_residual_mass_of_the_skewed_rows(k, dtype):
    """Σ (c p - q̃)_+ summed in rank order against float64 sums over q̃ by id, on strided rows
    (a slice of levels, as GBV passes them)."""
    from service.verification.gbv import mass_ranked_below, skewed_probs

    q, p, lam, order, key = skew_inputs(k, dtype, lead=(2, 4))
    c = torch.rand(2, 3, dtype=torch.float64, device=DEVICE)
    q_tilde = skewed_probs(q, mass_ranked_below(key, q.view(-1, 5000)).view(q.shape), lam, k)
    want = reference(p[:, 1:], q_tilde[:, 1:], torch.ones_like(c), c=c)[0]
    got = kernels.skewed_excess(q[:, 1:], p[:, 1:], order[:, 1:], lam[:, 1:], c, k)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got.shape == (2, 3) and got.dtype == torch.float64 and (got > 0).all()


# Every verifier whose accelerator path calls the kernels (gbv and traversal at K = 1
# through block verification's R; specinfer at K = 1 is token verification, which does not).
CALLERS = [("block", 1), ("greedy_block", 1), ("gbv", 1), ("traversal", 1), ("spectr_gbv", 1)]
CALLERS += [(m, 3) for m in ("specinfer", "gbv", "traversal", "spectr_gbv")]


@pytest.mark.parametrize("method,k", CALLERS)
def test_accelerator_paths_give_the_same_tokens_with_the_kernels(method, k, monkeypatch):
    """Every call site: each verifier's fixed-shape path (the one a GPU runs) with the kernels
    against the same path with the torch ops, over two steps so that greedy BV's carried
    records go through them too. The masses differ by rounding only, so the tokens agree on
    these inputs, and the carried joints to ~1e-6."""
    take_accelerator_paths(monkeypatch)
    calls = []
    for name in ("row_masses", "skewed_rows", "skewed_excess"):
        real = getattr(kernels, name)
        monkeypatch.setattr(
            kernels,
            name,
            lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw),
        )
    runs = {}
    for fused in (False, True):
        # on CPU the interpreter runs them: every device passes where the rows fit
        monkeypatch.setattr(kernels, "applies", kernels.fit if fused else lambda p, q: False)
        carry, runs[fused] = None, []
        for step, regime in enumerate(["realistic", "disjoint"]):
            tokens, q, p = inputs(regime, 6, k, 4, vocab=300, device=DEVICE)
            gen = torch.Generator(DEVICE).manual_seed(step)
            out = verify(method, tokens, q, p, gen, carry=carry, validate=False)
            carry = out.carry
            runs[fused].append(out)
    # the fused run went through the kernels: GBV's skew at K > 1, the masses elsewhere
    gbv_skew = method == "gbv" and k > 1
    assert set(calls) == ({"skewed_excess", "skewed_rows"} if gbv_skew else {"row_masses"})
    for plain, fused in zip(runs[False], runs[True], strict=True):
        assert same_tokens(plain, fused)
        if plain.carry is not None:
            torch.testing.assert_close(fused.carry.log_p, plain.carry.log_p, rtol=1e-6, atol=1e-6)
