"""The fused CUDA row passes (verification/kernels.py, gbv/kernels.py, top_down/kernels.py)
against float64 torch sums, and the verifiers' accelerator paths with them against the same
paths without them.

On CUDA (scripts/gpu_checks.sh) they run as compiled; without a GPU they run on CPU tensors
under Triton's interpreter (TRITON_INTERPRET=1, which conftest.py sets): the same kernel
code, executed op by op. Skipped where triton is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockspec.verification import Backend, kernels, verify
from blockspec.verification.gbv import kernels as gbv_kernels
from blockspec.verification.top_down import kernels as top_down_kernels
from tests.test_verify_cost import inputs, same_tokens

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
    # read = (mask, value): the rows whose mask is value, the others 0 (traversal's segments)
    mask = torch.rand(4, 5, generator=gen).lt(0.5).to(DEVICE)
    for value in (False, True):
        part = kernels.row_masses(p, q, ones, c=c, rows=rows, read=(mask, value))[0]
        torch.testing.assert_close(part, torch.where(mask == value, above, 0.0), rtol=0, atol=0)


def skew_inputs(k, dtype, lead=(6,), vocab=5000):
    """Rows q, p [*lead, V] with ties at +inf in the first (q = 0 on 100 tokens), λ [*lead],
    and GBV's rank order of each row."""
    from blockspec.verification.gbv import ranking_key
    from blockspec.verification.sorting import ascending_order

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
    from blockspec.verification.gbv import mass_ranked_below, skewed_probs

    q, _, lam, order, key = skew_inputs(k, dtype, lead=(2, 3))
    want = skewed_probs(q, mass_ranked_below(key, q.view(-1, 5000)).view(q.shape), lam, k)
    got = gbv_kernels.skewed_rows(q, order, lam, k)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(got.double().sum(-1), torch.ones_like(lam), rtol=0, atol=1e-5)
    rows = torch.tensor([5, 0, 3], device=DEVICE)
    picked = gbv_kernels.skewed_rows(q, order, lam, k, rows=rows)
    torch.testing.assert_close(picked, want.view(-1, 5000)[rows], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_skewed_excess_is_the_residual_mass_of_the_skewed_rows(k, dtype):
    """Σ (c p - q̃)_+ summed in rank order against float64 sums over q̃ by id, on strided rows
    (a slice of levels, as GBV passes them)."""
    from blockspec.verification.gbv import mass_ranked_below, skewed_probs

    q, p, lam, order, key = skew_inputs(k, dtype, lead=(2, 4))
    c = torch.rand(2, 3, dtype=torch.float64, device=DEVICE)
    q_tilde = skewed_probs(q, mass_ranked_below(key, q.view(-1, 5000)).view(q.shape), lam, k)
    want = reference(p[:, 1:], q_tilde[:, 1:], torch.ones_like(c), c=c)[0]
    got = gbv_kernels.skewed_excess(q[:, 1:], p[:, 1:], order[:, 1:], lam[:, 1:], c, k)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got.shape == (2, 3) and got.dtype == torch.float64 and (got > 0).all()


def kseq_case(dtype, gen, rows=64, vocab=1000, k=4):
    """SpecTr nodes: target/draft rows (a row with p = q: ρ* = 1; one with q = 0 on 100
    tokens: ratios +inf), 1..k candidates drawn from q, and candidates' uniforms near 1 on
    every other row, so that rejections, and the residual draw, are common."""
    p = torch.randn(rows, vocab, generator=gen, dtype=torch.float64).mul(3).softmax(-1)
    q = (p.log() + torch.randn(rows, vocab, generator=gen, dtype=torch.float64)).softmax(-1)
    q[0] = p[0]
    q[1, :100] = 0
    q = q / q.sum(-1, keepdim=True)
    cand = torch.multinomial(q, k, replacement=True, generator=gen)
    n = torch.randint(1, k + 1, (rows,), generator=gen)
    is_cand = torch.arange(k) < n.unsqueeze(-1)
    u = torch.rand(rows, k + 1, generator=gen, dtype=torch.float64)
    u[::2, :k] = 1 - u[::2, :k] * 1e-3
    return [x.to(DEVICE) for x in (p.to(dtype), q.to(dtype), cand, is_cand, u)]


@pytest.mark.parametrize(
    "dtype,block,programs",
    [(torch.float32, 128, None), (torch.float64, 64, 64), (torch.bfloat16, 256, 1)],
)
def test_kseq_token_is_spectrs_node_rule(dtype, block, programs):
    """ρ*, β(ρ*) (where several candidates pass: one is token verification, unread by the
    rounds) against kseq_rho_all's search, and the token against spectr_rule's torch ops
    (the tests and, where all are rejected, the residual's inverse-CDF draw) on the same
    uniforms: equal up to the last bits of ρ (the probes' rounding) and of the sums. Rows
    split into 8 chunks (as on an H100 at up to 33 rows), 4, or none (programs=1). 16 rows
    (9 residual draws, 3 of them at one candidate): the interpreter runs each program's every
    round in Python, the test's whole cost, which grows with the rows."""
    from blockspec.verification import top_down

    gen = torch.Generator().manual_seed(3)
    p, q, cand, is_cand, u = kseq_case(dtype, gen, rows=16)
    token, rho, beta = top_down_kernels.kseq_token(
        p, q, cand, is_cand, u, top_down.SEARCH_NARROW, block=block, programs=programs
    )
    plain = Backend.TORCH_DEVICE  # the torch ops of an accelerator, without the kernels
    want_rho, want_beta = top_down.kseq_rho_all(p, q, is_cand.sum(-1).double(), plain)
    torch.testing.assert_close(rho, want_rho, rtol=1e-8, atol=0)  # a few steps of the grid
    several = is_cand.sum(-1) > 1  # one candidate: ρ* = 1, its row never read, β left at 0
    torch.testing.assert_close(beta[several], want_beta[several], rtol=1e-12, atol=0)
    assert rho[0] == 1 and (rho[~several] == 1).all() and (beta[~several] == 0).all()
    want = top_down.spectr_rule(plain, p, q, cand, is_cand, u)
    rejected = ~(is_cand & (u[:, :-1] * rho[:, None] * q.gather(-1, cand) < p.gather(-1, cand)))
    drawn = rejected.all(-1)
    assert drawn.sum() >= 8 and (drawn & ~several).sum() >= 3  # the residual draw is exercised
    if dtype != torch.bfloat16:
        assert torch.equal(token, want)
    else:  # the kernel computes a bfloat16 row's residual in float32, torch in bfloat16
        assert (token == want).float().mean() > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_mass_ranked_below_token_is_gbvs_c_at_the_path(dtype, monkeypatch):
    """C(x) by (key, id) against drafted_mass_below's torch ops, on keys with ties (a row
    with p = q: every key 1, so only the ids order it) and +inf keys (q = 0), rows split
    over 4 programs."""
    from blockspec.verification import gbv

    gen = torch.Generator().manual_seed(5)
    p, q, cand, _, _ = kseq_case(dtype, gen, rows=24)
    q = q.view(4, 6, -1)
    key = gbv.ranking_key(p.view(4, 6, -1), q)
    x = cand[:, 0].view(4, 6)
    monkeypatch.setattr(kernels, "BLOCK", 256)
    got = gbv_kernels.mass_ranked_below_token(key, q, x)
    want = gbv.drafted_mass_below(key, q, x, Backend.TORCH_DEVICE).double()
    assert got.shape == (4, 6) and got.dtype == torch.float64
    tol = 1e-6 if dtype != torch.bfloat16 else 1e-2  # torch sums bfloat16 products in bf16
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * 1e-3)
    assert got[0, 0] > 0  # the p = q row: the ids below x


@pytest.mark.parametrize(
    "dtype,block", [(torch.float32, 256), (torch.float64, 128), (torch.bfloat16, 2048)]
)
def test_rrs_token_is_specinfers_node_rule(dtype, block, monkeypatch):
    """The token against specinfer_rule's torch ops (the levels' masses, the tests and, where
    all are rejected, level n_v's residual drawn by inverse CDF) on the same uniforms: the
    same sums up to their order, so the same tokens. Rows split into 4 and 8 chunks, or one."""
    from blockspec.verification import top_down

    gen = torch.Generator().manual_seed(4)
    p, q, cand, is_cand, u = kseq_case(dtype, gen, rows=32)
    monkeypatch.setattr(kernels, "BLOCK", block)
    token = top_down_kernels.rrs_token(p, q, cand, is_cand, u)
    want = top_down.specinfer_rule(Backend.TORCH_DEVICE, p, q, cand, is_cand, u)
    # a candidate's first test is TV's: where every one fails it, the draw is exercised
    p_0, q_0 = (x.float().gather(-1, cand[:, :1]).squeeze(-1) for x in (p, q))
    assert (u[:, 0] * q_0 >= p_0).sum() >= 10
    drawn = ~((token[:, None] == cand) & is_cand).any(-1)  # no candidate: the residual draw
    assert drawn.sum() >= 5
    assert torch.equal(token, want)


# The kernels' pointer arguments that are not float64 (rows' pointers are set per case).
POINTERS = {
    "order_ptr": "*i64",
    "sel_ptr": "*i64",
    "cand_ptr": "*i64",
    "token_ptr": "*i64",
    "is_cand_ptr": "*i8",
    "read_ptr": "*i1",
}


def compile_for_sm90() -> None:
    """Compile every kernel for an H100/H200 (sm_90, with the ptxas Triton ships): no GPU."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    round_kernel, tests_kernel, draw_kernel = top_down_kernels._kseq_kernels()
    level_kernel, rrs_tests_kernel, rrs_draw_kernel = top_down_kernels._rrs_kernels()
    for f64 in (False, True):
        rows = "*fp64" if f64 else "*fp32"
        kseq = {"K": 3, "KP": 4, "WAYS": 16, "SP": 8, "BLOCK": 128, "F64": f64}
        kseq |= {"FIRST": False, "BF16": False}
        cases = [
            (
                kernels._kernel(),
                {"p_ptr": rows, "q_ptr": rows, "max_scalar": "fp64"},
                {"HAS_S": True, "HAS_C": True, "HAS_SEL": True, "F64": f64, "BLOCK": 2048}
                | {"HAS_READ": True, "READ": 0},
            ),
            *[
                (
                    gbv_kernels._skew_kernel(),
                    {"q_ptr": rows, "p_ptr": rows},
                    {"K": 3, "HAS_P": has_p, "HAS_SEL": not has_p, "F64": f64, "BLOCK": 1024},
                )
                for has_p in (False, True)
            ],
            *[
                (round_kernel, {"p_ptr": rows, "q_ptr": rows}, {**kseq, "FIRST": first})
                for first in (False, True)
            ],
            (round_kernel, {"p_ptr": "*bf16", "q_ptr": "*bf16"}, {**kseq, "BF16": True}),
            (tests_kernel, {"p_ptr": rows, "q_ptr": rows}, kseq),
            (draw_kernel, {"p_ptr": rows, "q_ptr": rows}, kseq),
            (
                gbv_kernels._below_kernel(),
                {"key_ptr": "*fp32", "q_ptr": rows, "x_ptr": "*i64"},
                {"BLOCK": 2048},
            ),
            *[
                (kernel, {"p_ptr": rows, "q_ptr": rows, "max_scalar": "fp32"}, kseq | {"LP": 4})
                for kernel in (level_kernel, rrs_tests_kernel, rrs_draw_kernel)
            ],
        ]
        for kernel, types, constants in cases:
            names = kernel.arg_names

            constants = {k: v for k, v in constants.items() if k in names}

            def arg_type(name, types=types, constants=constants):
                if name in constants:
                    return "constexpr"
                if name.endswith("_ptr"):
                    return types.get(name, POINTERS.get(name, "*fp64"))
                return types.get(name, "i32")

            signature = {name: arg_type(name) for name in names}
            constexprs = {(names.index(k),): v for k, v in constants.items()}
            source = ASTSource(kernel, signature, constexprs=constexprs)
            assert triton_compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the other tests compile the kernels")
def test_kernels_compile_for_a_gpu():
    """The interpreter runs a kernel op by op and misses what only the compiler checks (a
    variable whose type differs between the branches of an `if` failed on an H200 that way),
    so the kernels are also compiled here, in a process without the interpreter (it patches
    triton.language)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.test_verify_kernels import compile_for_sm90; compile_for_sm90()"
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]


# Every verifier whose accelerator path calls the kernels (gbv and traversal at K = 1
# through block verification's R; specinfer at K = 1 is token verification, which does not).
CALLERS = [("block", 1), ("greedy_block", 1), ("gbv", 1), ("traversal", 1), ("spectr_gbv", 1)]
CALLERS += [(m, 3) for m in ("specinfer", "spectr", "gbv", "traversal", "spectr_gbv")]


@pytest.mark.parametrize("method,k", CALLERS)
def test_accelerator_paths_give_the_same_tokens_with_the_kernels(method, k, monkeypatch):
    """Every call site: each verifier's fixed-shape path (the one a GPU runs) with the kernels
    against the same path with the torch ops, over two steps so that greedy BV's carried
    records go through them too. The masses differ by rounding only, so the tokens agree on
    these inputs, and the carried joints to ~1e-6."""
    calls = []
    launchers = {kernels: ["row_masses"], gbv_kernels: ["skewed_rows", "skewed_excess"]}
    launchers[top_down_kernels] = ["kseq_token", "rrs_token"]
    for module, names in launchers.items():
        for name in names:
            real = getattr(module, name)
            monkeypatch.setattr(
                module,
                name,
                lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw),
            )
    runs = {}
    for fused in (False, True):
        # on CPU the interpreter runs the kernels: the triton backend on CPU tensors
        backend = Backend.TRITON if fused else Backend.TORCH_DEVICE
        carry, runs[fused] = None, []
        for step, regime in enumerate(["realistic", "disjoint"]):
            tokens, q, p = inputs(regime, 4, k, 4, vocab=300, device=DEVICE)
            gen = torch.Generator(DEVICE).manual_seed(step)
            out = verify(method, tokens, q, p, gen, carry=carry, validate=False, backend=backend)
            carry = out.carry
            runs[fused].append(out)
    # the fused run went through the kernels: GBV's skew, SpecTr's and SpecInfer's node at
    # K > 1, the masses elsewhere
    fused_by = {"gbv": {"skewed_excess", "skewed_rows"}, "spectr": {"kseq_token"}}
    fused_by["specinfer"] = {"rrs_token"}
    assert set(calls) == (fused_by.get(method, {"row_masses"}) if k > 1 else {"row_masses"})
    for plain, fused in zip(runs[False], runs[True], strict=True):
        assert same_tokens(plain, fused)
        if plain.carry is not None:
            torch.testing.assert_close(fused.carry.log_p, plain.carry.log_p, rtol=1e-6, atol=1e-6)
