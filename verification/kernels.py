"""Fused row passes for CUDA (Triton): the residual masses that most verifiers sum over V.

Per row, block verification's levels need R = Σ_x (p_i p(x) - q(x))_+, traversal's the same
with its budgets α, SpecInfer's rejections and every M_new step F(t) = Σ_x (p(x) - t q(x))_+,
and greedy BV's tests the two halves of e = (p - t q)_+ - s q: Σ e_+ and Σ (-e)_+. In torch
ops that is an addcmul (or mul and sub), a clamp and a sum, each a pass over [rows, V]
(greedy BV: five passes and a temporary; traversal first gathers its path rows). On a GPU such
passes were most of SpecTr-GBV*'s GPU time, so :func:`row_masses` is all of them in one kernel
that reads p and q once, in place (docs/verification_benchmark.md has the current times).

GBV's skewed draft also walks rows in rank order, one program per row (:func:`skewed_rows`,
:func:`skewed_excess`). SpecTr's node rule (:func:`kseq_token`, kernels in spectr_kernels.py)
needs no order: each round of its ρ* search sums P below and Q above every probe over the row
directly, in one kernel whose programs each take a chunk of a row (a sort and a walk of the
sorted row, one program per row, leaves most of the GPU idle on few rows). SpecInfer's node
(:func:`rrs_token`, rrs_kernels.py) is one such kernel per rejection level, then the tests and
the residual's draw: K + 2 kernels where the torch ops launched ~60.

The sums accumulate in float64 (the torch ops sum in the rows' dtype and then widen), and
rows below float32 are computed in float32: the same masses up to rounding, never less
accurate; callers cast them to the torch ops' dtype. On CPU GBV and traversal run as numba
loops a request (gbv/loops.py, traversal/loops.py) and SpecTr's ρ* as one loop a row
(top_down/loops.py).
"""

from __future__ import annotations

import functools

import torch

# Columns per program step, and programs per row (rows are few; splitting each row over
# several programs keeps every multiprocessor streaming).
BLOCK = 2048
MAX_SPLITS = 8
# GBV's skew walks each row in rank order (a running sum), one program per row.
SKEW_BLOCK = 1024
# SpecTr's node sums every probe of a round at once ([probes, KSEQ_BLOCK] float64 a step),
# each row split over programs: about KSEQ_PROGRAMS_PER_SM a multiprocessor in all. The best
# of the settings scripts/bench_kseq_knobs.py compares (rerun it on a new GPU).
KSEQ_BLOCK = 128
KSEQ_DRAW_BLOCK = 1024  # the residual's draw: a running sum, wide steps (draw_residual)
KSEQ_WARPS = 4
KSEQ_PROGRAMS_PER_SM = 2
KSEQ_MAX_SPLITS = 64


@functools.cache
def _triton():
    """The triton module, or None where it is missing (CPU-only installs)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def available() -> bool:
    """Whether Triton is installed: the ``triton`` backend's condition (backends.py)."""
    return _triton() is not None


def fit(p: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether :func:`row_masses` can read rows p, q: Triton is there, and they have one shape
    with at most three leading dims, contiguous along V."""
    return (
        p.shape == q.shape
        and p.dim() <= 4
        and p.stride(-1) == q.stride(-1) == 1
        and p.numel() > 0
        and _triton() is not None
    )


@functools.cache
def _kernel():
    triton, tl = _triton()

    @triton.jit
    def row_masses_kernel(
        p_ptr,
        q_ptr,
        t_ptr,  # [N] float64
        s_ptr,  # [N] float64 (unused without HAS_S)
        c_ptr,  # [N] float64: p's scale (unused without HAS_C)
        sel_ptr,  # [d0] int64: index into p's and q's first dim (unused without HAS_SEL)
        read_ptr,  # [N] bool: a row is read where this is READ (unused without HAS_READ)
        out_ptr,  # [N, splits, 2] float64
        V,
        span,  # columns per program, a multiple of BLOCK
        d1,
        d2,  # the leading dims after the first: row r = (i, j, l)
        p_s0,
        p_s1,
        p_s2,
        q_s0,
        q_s1,
        q_s2,
        max_scalar,  # as_row_scalars' clamp for the rows' dtype
        HAS_S: tl.constexpr,
        HAS_C: tl.constexpr,
        HAS_SEL: tl.constexpr,
        HAS_READ: tl.constexpr,
        READ: tl.constexpr,
        F64: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        part = tl.program_id(1)
        if HAS_READ:  # a row left unread sums to 0
            span = span * (tl.load(read_ptr + row).to(tl.int32) == READ).to(tl.int32)
        i = row // (d1 * d2)
        if HAS_SEL:
            i = tl.load(sel_ptr + i)
        j = (row // d2) % d1
        l_ = row % d2
        p_row = p_ptr + i.to(tl.int64) * p_s0 + j.to(tl.int64) * p_s1 + l_.to(tl.int64) * p_s2
        q_row = q_ptr + i.to(tl.int64) * q_s0 + j.to(tl.int64) * q_s1 + l_.to(tl.int64) * q_s2
        compute = tl.float64 if F64 else tl.float32
        t = tl.minimum(tl.load(t_ptr + row), max_scalar).to(compute)
        if HAS_S:
            s = tl.minimum(tl.load(s_ptr + row), max_scalar).to(compute)
        if HAS_C:
            c = tl.load(c_ptr + row).to(compute)
        above = tl.zeros([BLOCK], dtype=tl.float64)
        below = tl.zeros([BLOCK], dtype=tl.float64)
        start = part * span
        for off in range(0, span, BLOCK):
            cols = start + off + tl.arange(0, BLOCK)
            inside = cols < V
            p = tl.load(p_row + cols, mask=inside, other=0.0).to(compute)
            q = tl.load(q_row + cols, mask=inside, other=0.0).to(compute)
            if HAS_C:
                p = c * p
            e = tl.maximum(p - t * q, 0.0)  # m = (c p - t q)_+
            if HAS_S:
                e = e - s * q
                below += tl.maximum(-e, 0.0).to(tl.float64)
            above += tl.maximum(e, 0.0).to(tl.float64)
        out = out_ptr + (row * tl.num_programs(1) + part) * 2
        tl.store(out, tl.sum(above, axis=0))
        tl.store(out + 1, tl.sum(below, axis=0))

    return row_masses_kernel


def row_chunks(V: int) -> tuple[int, int]:
    """(columns per program, programs per row) of a row of V split for the one-pass kernels
    (:func:`row_masses` and those that must sum the same chunks): whole BLOCKs, at most
    MAX_SPLITS programs, none empty."""
    triton, _ = _triton()
    tiles = triton.cdiv(V, BLOCK)
    span = triton.cdiv(tiles, min(MAX_SPLITS, tiles)) * BLOCK
    return span, triton.cdiv(V, span)


def row_masses(
    p: torch.Tensor,  # [..., V]: target rows (≤ 3 leading dims, contiguous along V)
    q: torch.Tensor,  # [..., V]: draft rows, same shape
    t: torch.Tensor,  # [...] float64: offsets
    s: torch.Tensor | None = None,  # [...] float64: draft scale, or None
    c: torch.Tensor | None = None,  # [...]: target scale, or None (1)
    rows: torch.Tensor | None = None,  # [n] int64: read the rows p[rows], q[rows] in place
    read: tuple[torch.Tensor, bool] | None = None,  # ([...] bool, value): read rows where equal
) -> tuple[torch.Tensor, torch.Tensor]:
    """With m = (c p - t q)_+ and e = m - s q (e = m without s): (Σ e_+, Σ (-e)_+) over V,
    float64 [...] each ([n, ...] with ``rows``). Without s the first is F(t) = Σ (p - t q)_+
    and the second is 0. With ``read`` = (mask, value), a row whose mask is not value is not
    read and sums to 0 (the mask passed as it is: no copy). No host reads (capturable in a
    CUDA graph)."""
    V = p.shape[-1]
    lead = p.shape[:-1] if rows is None else torch.Size([rows.shape[0], *p.shape[1:-1]])
    pad = 3 - len(lead)  # rows (i, j, l) of up to 3 leading dims; i is read through `rows`
    d0, d1, d2 = list(lead) + [1] * pad
    p_strides = list(p.stride()[:-1]) + [0] * pad
    q_strides = list(q.stride()[:-1]) + [0] * pad
    n = d0 * d1 * d2
    span, splits = row_chunks(V)

    def per_row(x):  # [...] -> [n] float64
        return x.double().expand(lead).reshape(n).contiguous()

    t = per_row(t)
    s_flat = t if s is None else per_row(s)
    c_flat = t if c is None else per_row(c)
    read_flat = t if read is None else read[0].expand(lead).reshape(n).contiguous()
    out = torch.empty(n, splits, 2, dtype=torch.float64, device=p.device)
    _kernel()[(n, splits)](
        p,
        q,
        t,
        s_flat,
        c_flat,
        t if rows is None else rows,
        read_flat,
        out,
        V,
        span,
        d1,
        d2,
        *p_strides,
        *q_strides,
        torch.finfo(p.dtype).max / 4,
        HAS_S=s is not None,
        HAS_C=c is not None,
        HAS_SEL=rows is not None,
        HAS_READ=read is not None,
        READ=int(read[1]) if read is not None else 0,
        F64=torch.float64 in (p.dtype, q.dtype),
        BLOCK=BLOCK,
        num_warps=8,
    )
    sums = out.sum(1)  # [n, 2]
    return sums[:, 0].view(lead), sums[:, 1].view(lead)


def excess_mass(
    p: torch.Tensor,  # [..., V]: target rows
    q: torch.Tensor,  # [..., V]: draft rows
    c: torch.Tensor,  # [...]: the target's scale per row
    rows: torch.Tensor | None = None,  # [n] int64: read p[rows], q[rows] in place
    read: tuple[torch.Tensor, bool] | None = None,  # as row_masses: rows read, others 0
) -> torch.Tensor:
    """Σ_x (c p(x) - q(x))_+ float64 [...] ([n, ...] with ``rows``): block verification's R
    (c = p_i) and traversal's masses (c = α); row_masses with t = 1."""
    ones = torch.ones_like(c, dtype=torch.float64)
    return row_masses(p, q, ones, c=c, rows=rows, read=read)[0]


@functools.cache
def _below_kernel():
    triton, tl = _triton()

    @triton.jit
    def below_kernel(
        key_ptr,  # [N, V] float32: ranking keys, contiguous
        q_ptr,  # [N, V]: draft rows (row stride q_s0)
        x_ptr,  # [N] int64: a token per row
        out_ptr,  # [N, splits] float64
        V,
        span,  # columns per program, a multiple of BLOCK
        q_s0,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        key_row = key_ptr + row * V
        q_row = q_ptr + row * q_s0
        x = tl.load(x_ptr + row)
        key_x = tl.load(key_row + x)
        mass = tl.zeros([BLOCK], dtype=tl.float64)
        start = part * span
        for off in range(0, span, BLOCK):
            cols = start + off + tl.arange(0, BLOCK)
            inside = cols < V
            key = tl.load(key_row + cols, mask=inside, other=0.0)
            q = tl.load(q_row + cols, mask=inside, other=0.0)
            below = inside & ((key < key_x) | ((key == key_x) & (cols < x)))  # ties by id
            mass += tl.where(below, q.to(tl.float64), 0.0)
        tl.store(out_ptr + row * tl.num_programs(1) + part, tl.sum(mass, axis=0))

    return below_kernel


def mass_ranked_below_token(
    key: torch.Tensor,  # [..., V] float32: each row's ranking key (gbv.ranking_key)
    q: torch.Tensor,  # [..., V]: draft rows, same leading shape
    x: torch.Tensor,  # [...] int64: a token per row
) -> torch.Tensor:
    """Σ q(x') over the tokens x' ranked below x in each row by (key, id): GBV's C at the
    drafted token (gbv.drafted_mass_below), float64 [...]. One pass over key and q, the row
    split over programs as in :func:`row_masses`."""
    V = q.shape[-1]
    key2, q2 = key.reshape(-1, V).contiguous(), q.reshape(-1, V)
    x = x.reshape(-1).contiguous()
    span, splits = row_chunks(V)
    out = torch.empty(x.shape[0], splits, dtype=torch.float64, device=q.device)
    _below_kernel()[(x.shape[0], splits)](
        key2, q2, x, out, V, span, q2.stride(0), BLOCK=BLOCK, num_warps=8
    )
    return out.sum(1).view(key.shape[:-1])


@functools.cache
def _skew_kernel():
    triton, tl = _triton()

    @triton.jit
    def skew_kernel(
        q_ptr,  # [d0, d1, V]: draft rows by token id
        p_ptr,  # [d0, d1, V]: target rows by token id (unused without HAS_P)
        order_ptr,  # [d0, d1, V] int64: each row's token ids in rank order
        lam_ptr,  # [d0 * d1] float64: λ of each row's prefix
        c_ptr,  # [programs] float64: p's scale (unused without HAS_P)
        sel_ptr,  # [programs] int64: the flat row (i * d1 + l) each program takes (HAS_SEL)
        out_ptr,  # HAS_P: [programs] float64 masses; else [programs, V] q̃ by id
        V,
        d1,
        q_s0,
        q_s1,
        p_s0,
        p_s1,
        o_s0,
        o_s1,
        K: tl.constexpr,
        HAS_P: tl.constexpr,
        HAS_SEL: tl.constexpr,
        F64: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row = tl.load(sel_ptr + pid) if HAS_SEL else pid.to(tl.int64)
        i = row // d1
        l_ = row % d1
        q_row = q_ptr + i * q_s0 + l_ * q_s1
        order_row = order_ptr + i * o_s0 + l_ * o_s1
        compute = tl.float64 if F64 else tl.float32
        lam = tl.load(lam_ptr + row)
        inv = (1 / (lam + 1)).to(compute)  # divided through by (λ+1): no overflow
        t = (lam / (lam + 1)).to(compute)
        norm = 1.0  # S_K(1, t)
        t_pow = 1.0
        for _ in tl.static_range(K - 1):
            t_pow = t_pow * t
            norm = norm + t_pow
        if HAS_P:
            p_row = p_ptr + i * p_s0 + l_ * p_s1
            c = tl.load(c_ptr + pid).to(compute)
        carried = tl.sum(tl.zeros([BLOCK], tl.float64), axis=0)  # q-mass of the ranks before
        excess = tl.zeros([BLOCK], dtype=tl.float64)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            ids = tl.load(order_row + cols, mask=inside, other=0)
            q64 = tl.load(q_row + ids, mask=inside, other=0.0).to(tl.float64)
            below = (carried + tl.cumsum(q64, axis=0) - q64).to(compute)  # C(x)
            carried += tl.sum(q64, axis=0)
            q = q64.to(compute)
            b = t + below * inv
            a = b + q * inv
            # S_K(a, b) = Σ_{j<K} a^j b^(K-1-j), so that a^K - b^K = (a - b) S_K: no cancellation
            total = tl.full([BLOCK], 1.0, compute)
            b_pow = tl.full([BLOCK], 1.0, compute)
            for _ in tl.static_range(K - 1):
                b_pow = b_pow * b
                total = total * a + b_pow
            skewed = total * q / norm
            if HAS_P:
                p = tl.load(p_row + ids, mask=inside, other=0.0).to(compute)
                excess += tl.maximum(c * p - skewed, 0.0).to(tl.float64)
            else:
                out_row = out_ptr + pid.to(tl.int64) * V
                tl.store(out_row + ids, skewed.to(out_ptr.dtype.element_ty), mask=inside)
        if HAS_P:
            tl.store(out_ptr + pid, tl.sum(excess, axis=0))

    return skew_kernel


def _run_skew(q, p, order, lam, k, c=None, rows=None):
    """Launch skew_kernel over rows [d0, d1, V] (or [N, V]) of q, p, order: one program per
    row, or per entry of ``rows`` (flat indices i * d1 + l)."""
    q3, p3, o3 = (x if x.dim() == 3 else x.unsqueeze(1) for x in (q, p, order))
    d0, d1, V = q3.shape
    programs = d0 * d1 if rows is None else rows.shape[0]
    if c is None:
        out = torch.empty(programs, V, dtype=q.dtype, device=q.device)
    else:
        out = torch.empty(programs, dtype=torch.float64, device=q.device)
        c = c.double().reshape(programs).contiguous()
    lam = lam.double().reshape(d0 * d1).contiguous()
    _skew_kernel()[(programs,)](
        q3,
        p3,
        o3,
        lam,
        lam if c is None else c,
        lam if rows is None else rows,
        out,
        V,
        d1,
        q3.stride(0),
        q3.stride(1),
        p3.stride(0),
        p3.stride(1),
        o3.stride(0),
        o3.stride(1),
        K=k,
        HAS_P=c is not None,
        HAS_SEL=rows is not None,
        F64=q.dtype == torch.float64,
        BLOCK=SKEW_BLOCK,
        num_warps=4,
    )
    return out


def skewed_rows(
    q: torch.Tensor,  # [..., V]: draft rows by id (≤ 2 leading dims, contiguous along V)
    order: torch.Tensor,  # [..., V] int64: each row's token ids in GBV's rank order
    lam: torch.Tensor,  # [...] float64: λ of each row's prefix
    k: int,
    rows: torch.Tensor | None = None,  # [n] int64: only these rows (flat indices), or None
) -> torch.Tensor:
    """GBV's q̃ (gbv.skewed_probs, C(x) the q-mass ranked below x) written by token id:
    [..., V] in q's dtype ([n, V] with ``rows``). One pass per row instead of a gather, a
    scan, a scatter of C back to id order and ~3k elementwise passes."""
    out = _run_skew(q, q, order, lam, k, rows=rows)
    return out if rows is not None else out.view(q.shape)


def skewed_excess(
    q: torch.Tensor,  # [..., V]: draft rows by id (≤ 2 leading dims, contiguous along V)
    p: torch.Tensor,  # [..., V]: the target rows at the same prefixes
    order: torch.Tensor,  # [..., V] int64: each row's token ids in GBV's rank order
    lam: torch.Tensor,  # [...] float64: λ of each row's prefix
    c: torch.Tensor,  # [...]: the target's scale per row (block verification's p_i)
    k: int,
) -> torch.Tensor:
    """R = Σ_x (c p(x) - q̃(x))_+ float64 [...], q̃ = GBV's skewed draft of each row, summed
    in rank order: q̃ is never written, p is read through the order. Block verification's
    residual mass on the skewed draft without the [..., V] row of q̃."""
    return _run_skew(q, p, order, lam, k, c=c).view(q.shape[:-1])


@functools.cache
def _kseq_kernels():
    from . import spectr_kernels

    return spectr_kernels.round_kernel, spectr_kernels.tests_kernel, spectr_kernels.draw_kernel


def kseq_token(
    p_row: torch.Tensor,  # [B, V]: target rows at the nodes (contiguous along V)
    q_row: torch.Tensor,  # [B, V]: draft rows
    cand: torch.Tensor,  # [B, K] int64: the node's candidates
    is_cand: torch.Tensor,  # [B, K] bool: the ones that pass through it
    u: torch.Tensor,  # [B, K+1]: the node's uniforms
    search: tuple[int, int],  # (ways, rounds) of the ρ* search, ways a power of two >= 4
    block: int | None = None,  # columns per step, KSEQ_BLOCK (tests take other ones)
    programs: int | None = None,  # programs per call, KSEQ_PROGRAMS_PER_SM a multiprocessor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SpecTr's node rule (top_down.spectr_rule) without a sort: kseq_rho_all's search for ρ*
    on the same grid, with f at each round's probes summed over the row directly (P below and
    Q above each probe), each row split into chunks over several programs; then β(ρ*), the K
    tests, and where all are rejected the residual draw by inverse CDF. -> (token [B] int64,
    ρ [B], β(ρ) [B] float64). rounds + 2 kernels, no host reads. A row with one candidate
    (below where the paths part, or a finished request's) is token verification: ρ* = 1,
    and the rounds skip it (β is left at 0 there; its residual does not read β)."""
    triton, _ = _triton()
    B, V = p_row.shape
    K = cand.shape[1]
    block = block or KSEQ_BLOCK
    ways, rounds = search
    if programs is None:
        programs = KSEQ_PROGRAMS_PER_SM * _multiprocessors(p_row.device)
    tiles = triton.cdiv(V, block)
    splits = max(1, min(tiles, KSEQ_MAX_SPLITS, triton.cdiv(programs, B)))
    chunk = triton.cdiv(tiles, splits) * block
    splits = triton.cdiv(V, chunk)  # no empty chunk
    dev = p_row.device
    state = torch.empty(2, B, (3 * splits + 2) * ways, dtype=torch.float64, device=dev)
    mass = torch.empty(B, splits, 2, dtype=torch.float64, device=dev)
    token = torch.empty(B, dtype=torch.int64, device=dev)
    rho = torch.empty(B, dtype=torch.float64, device=dev)
    beta = torch.empty_like(rho)
    is_cand = is_cand.to(torch.int8)
    round_kernel, tests_kernel, draw_kernel = _kseq_kernels()
    shape = dict(K=K, KP=triton.next_power_of_2(K), SP=triton.next_power_of_2(splits))
    grid = (B, splits)
    warps = dict(num_warps=KSEQ_WARPS)
    for r in range(rounds):
        round_kernel[grid](
            p_row, q_row, is_cand, state[(r + 1) % 2], state[r % 2], V,
            p_row.stride(0), q_row.stride(0), is_cand.stride(0), is_cand.stride(1),
            splits, chunk, WAYS=ways, FIRST=r == 0,
            BF16=p_row.dtype == q_row.dtype == torch.bfloat16,
            BLOCK=block, **shape, **warps,
        )  # fmt: skip
    f64 = torch.float64 in (p_row.dtype, q_row.dtype)
    tests_kernel[grid](
        p_row, q_row, cand, is_cand, u, state[(rounds - 1) % 2], mass, token, rho, beta, V,
        p_row.stride(0), q_row.stride(0), cand.stride(0), cand.stride(1),
        is_cand.stride(0), is_cand.stride(1), u.stride(0), u.stride(1),
        splits, chunk, WAYS=ways, F64=f64, BLOCK=block, **shape, **warps,
    )  # fmt: skip
    draw_kernel[grid](
        p_row, q_row, is_cand, u, mass, token, rho, beta, V,
        p_row.stride(0), q_row.stride(0), is_cand.stride(0), is_cand.stride(1),
        u.stride(0), u.stride(1), splits, chunk, F64=f64, BLOCK=KSEQ_DRAW_BLOCK, **shape,
        **warps,
    )  # fmt: skip
    return token, rho, beta


@functools.cache
def _rrs_kernels():
    from . import rrs_kernels

    return rrs_kernels.level_kernel, rrs_kernels.tests_kernel, rrs_kernels.draw_kernel


def rrs_token(
    p_row: torch.Tensor,  # [B, V]: target rows at the nodes (contiguous along V)
    q_row: torch.Tensor,  # [B, V]: draft rows
    cand: torch.Tensor,  # [B, K] int64: the node's candidates, in path order
    is_cand: torch.Tensor,  # [B, K] bool: the ones that pass through it
    u: torch.Tensor,  # [B, K+1]: the node's uniforms
) -> torch.Tensor:
    """SpecInfer's node rule (top_down.specinfer_rule): the K levels' masses
    F(t_j) = Σ (p - t_j q)_+, each row split into chunks as :func:`row_masses` splits it (the
    same sums); the tests; and where all are rejected level n_v's residual drawn by inverse
    CDF. -> token [B] int64. K + 2 kernels, no host reads (rrs_kernels.py); a level above a
    node's n candidates does not read its row."""
    triton, _ = _triton()
    B, V = p_row.shape
    K = cand.shape[1]
    chunk, splits = row_chunks(V)  # the chunks of row_masses: the same level sums
    dev = p_row.device
    levels = torch.empty(B, K + 1, splits, dtype=torch.float64, device=dev)
    mass = torch.empty(B, splits, 2, dtype=torch.float64, device=dev)
    token = torch.empty(B, dtype=torch.int64, device=dev)
    t_draw = torch.empty(B, dtype=torch.float64, device=dev)
    is_cand = is_cand.to(torch.int8)
    level_kernel, tests_kernel, draw_kernel = _rrs_kernels()
    grid = (B, splits)
    common = dict(
        SP=triton.next_power_of_2(splits),
        F64=torch.float64 in (p_row.dtype, q_row.dtype),
        BLOCK=BLOCK,
        num_warps=8,
    )
    work = torch.float64 if common["F64"] else torch.float32  # specinfer_rule's dtype
    max_scalar = torch.finfo(work).max / 4
    for level in range(1, K + 1):
        level_kernel[grid](
            p_row, q_row, is_cand, levels, level, V, p_row.stride(0), q_row.stride(0),
            is_cand.stride(0), is_cand.stride(1), splits, chunk, max_scalar, K=K,
            KP=triton.next_power_of_2(K), **common,
        )  # fmt: skip
    tests_kernel[grid](
        p_row, q_row, cand, is_cand, u, levels, mass, token, t_draw, V,
        p_row.stride(0), q_row.stride(0), cand.stride(0), cand.stride(1),
        is_cand.stride(0), is_cand.stride(1), u.stride(0), u.stride(1), splits, chunk,
        max_scalar, K=K, KP=triton.next_power_of_2(K), LP=triton.next_power_of_2(K + 1),
        **common,
    )  # fmt: skip
    draw_kernel[grid](
        p_row, q_row, u, mass, token, t_draw, V, p_row.stride(0), q_row.stride(0),
        u.stride(0), u.stride(1), splits, chunk, max_scalar, K=K, **common,
    )  # fmt: skip
    return token


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: an H100's count, so that tests split rows as a GPU would
