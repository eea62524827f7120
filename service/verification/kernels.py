"""Fused row passes for CUDA (Triton): the residual masses that most verifiers sum over V.

Per row, block verification's levels need R = Σ_x (p_i p(x) - q(x))_+, traversal's the same
with its budgets α, SpecInfer's rejections and every M_new step F(t) = Σ_x (p(x) - t q(x))_+,
and greedy BV's tests the two halves of e = (p - t q)_+ - s q: Σ e_+ and Σ (-e)_+. In torch
ops that is an addcmul (or mul and sub), a clamp and a sum, each a pass over [rows, V]
(greedy BV: five passes and a temporary; traversal first gathers its path rows). On an H200
at B = 32, K = 4, γ = 8, V = 32000 such passes took 0.8 of SpecTr-GBV*'s 1.5 ms of GPU time.
:func:`row_masses` is all of them in one kernel that reads p and q once, in place
(docs/verification_benchmark.md, "GPU, third stop").

Two verifiers also walk rows in rank order, one program per row: GBV's skewed draft
(:func:`skewed_rows`, :func:`skewed_excess`) and SpecTr's node rule (:func:`kseq_token`), whose
torch ops were ~200 small kernels a depth ("GPU, fourth stop").

The sums accumulate in float64 (the torch ops sum in the rows' dtype and then widen), and
rows below float32 are computed in float32: the same masses up to rounding, never less
accurate; callers cast them to the torch ops' dtype. On CPU GBV and traversal run as numba
loops a request (cpu_verifiers.py) and SpecTr's ρ* as one loop a row (cpu_kernels.py).
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
# SpecTr's node walks one row per program too, and there are only B rows: wide steps, so
# that few of them (each waits on gathers and cross-warp scans) cover a row.
KSEQ_BLOCK = 2048
KSEQ_WARPS = 8  # 8 float64 columns a thread: 182 registers, no spills (sm_90)


@functools.cache
def _triton():
    """The triton module, or None where it is missing (CPU-only installs)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def applies(p: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the verifiers take the kernels for rows p, q: on CUDA, where they :func:`fit`."""
    return p.device.type == "cuda" and fit(p, q)


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
        F64: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        part = tl.program_id(1)
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


def row_masses(
    p: torch.Tensor,  # [..., V]: target rows (≤ 3 leading dims, contiguous along V)
    q: torch.Tensor,  # [..., V]: draft rows, same shape
    t: torch.Tensor,  # [...] float64: offsets
    s: torch.Tensor | None = None,  # [...] float64: draft scale, or None
    c: torch.Tensor | None = None,  # [...]: target scale, or None (1)
    rows: torch.Tensor | None = None,  # [n] int64: read the rows p[rows], q[rows] in place
) -> tuple[torch.Tensor, torch.Tensor]:
    """With m = (c p - t q)_+ and e = m - s q (e = m without s): (Σ e_+, Σ (-e)_+) over V,
    float64 [...] each ([n, ...] with ``rows``). Without s the first is F(t) = Σ (p - t q)_+
    and the second is 0. No host reads (capturable in a CUDA graph)."""
    triton, _ = _triton()
    V = p.shape[-1]
    lead = p.shape[:-1] if rows is None else torch.Size([rows.shape[0], *p.shape[1:-1]])
    pad = 3 - len(lead)  # rows (i, j, l) of up to 3 leading dims; i is read through `rows`
    d0, d1, d2 = list(lead) + [1] * pad
    p_strides = list(p.stride()[:-1]) + [0] * pad
    q_strides = list(q.stride()[:-1]) + [0] * pad
    n = d0 * d1 * d2
    tiles = triton.cdiv(V, BLOCK)
    span = triton.cdiv(tiles, min(MAX_SPLITS, tiles)) * BLOCK
    splits = triton.cdiv(V, span)

    def per_row(x):  # [...] -> [n] float64
        return x.double().expand(lead).reshape(n).contiguous()

    t = per_row(t)
    s_flat = t if s is None else per_row(s)
    c_flat = t if c is None else per_row(c)
    out = torch.empty(n, splits, 2, dtype=torch.float64, device=p.device)
    _kernel()[(n, splits)](
        p,
        q,
        t,
        s_flat,
        c_flat,
        t if rows is None else rows,
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
) -> torch.Tensor:
    """Σ_x (c p(x) - q(x))_+ float64 [...] ([n, ...] with ``rows``): block verification's R
    (c = p_i) and traversal's masses (c = α); row_masses with t = 1."""
    ones = torch.ones_like(c, dtype=torch.float64)
    return row_masses(p, q, ones, c=c, rows=rows)[0]


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
def _kseq_kernel():
    triton, tl = _triton()

    @triton.jit
    def kseq_kernel(
        p_ptr,  # [B, V]: target rows by id (row stride p_s0)
        q_ptr,  # [B, V]: draft rows by id (row stride q_s0)
        key_ptr,  # [B, V]: each row's p/q by id (contiguous)
        ratio_ptr,  # [B, V]: the same, ascending (contiguous)
        order_ptr,  # [B, V] int64: the token ids in that order (contiguous)
        cand_ptr,  # [B, K] int64: the candidates
        is_cand_ptr,  # [B, K] int8: which of them pass through the node
        u_ptr,  # [B, K+1]: a uniform per candidate test, then one for the residual draw
        below_ptr,  # [B, 2, V] float64 scratch: P and Q below each rank
        token_ptr,  # [B] int64 out
        rho_ptr,  # [B] float64 out
        beta_ptr,  # [B] float64 out
        V,
        p_s0,
        q_s0,
        c_s0,
        c_s1,
        i_s0,
        i_s1,
        u_s0,
        u_s1,
        K: tl.constexpr,
        KP: tl.constexpr,  # K rounded up to a power of two
        WAYS: tl.constexpr,
        ROUNDS: tl.constexpr,
        F64: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        p_row = p_ptr + b * p_s0
        q_row = q_ptr + b * q_s0
        key_row = key_ptr + b * V
        p_below_row = below_ptr + b * 2 * V
        q_below_row = p_below_row + V
        ratio_row = ratio_ptr + b * V
        order_row = order_ptr + b * V
        compute = tl.float64 if F64 else tl.float32
        ks = tl.arange(0, KP)
        in_k = ks < K
        cand = tl.load(cand_ptr + b * c_s0 + ks * c_s1, mask=in_k, other=0)
        is_cand = tl.load(is_cand_ptr + b * i_s0 + ks * i_s1, mask=in_k, other=0) != 0
        n = tl.maximum(tl.sum(is_cand.to(tl.int32), axis=0), 1)
        lanes = tl.arange(0, BLOCK)
        zero = tl.sum(tl.zeros([BLOCK], tl.float64), axis=0)

        # f(ρ) = ρ β(ρ) - 1 + (1 - β(ρ))^n, β(ρ) = Q(ratio >= ρ)/Q + P(ratio < ρ)/ρ, is
        # nondecreasing, so one walk up the sorted ratios finds the segment that holds ρ*:
        # the first ratio r_a < n where f(r_a) >= 0 (j = a ratios below it: the first of a
        # tie), else the first ratio >= n. On (r_{a-1}, r_a] f is f_a, the same sums with P
        # and Q below a fixed; f_a is nondecreasing on all ρ > 0 too, and its root is ρ*, so
        # the search asks f_a whether a probe is feasible, inside the segment or not: no
        # probe reads the row.
        nf = n.to(tl.float64)
        q_sum = tl.zeros([BLOCK], tl.float64)  # summed across lanes once, after the loop
        for start in range(0, V, BLOCK):
            cols = start + lanes
            q_sum += tl.load(q_row + cols, mask=cols < V, other=0.0).to(tl.float64)
        q_total = tl.maximum(tl.sum(q_sum, axis=0), 1e-300)
        p_run, q_run = zero, zero  # P and Q below the block
        at = zero.to(tl.int32) + V  # the first r_a < n with f(r_a) >= 0; V: none
        past = zero.to(tl.int32) + V  # the first ratio >= n; V: none
        for start in range(0, V, BLOCK):
            cols = start + lanes
            inside = cols < V
            ids = tl.load(order_row + cols, mask=inside, other=0)
            p_ranked = tl.load(p_row + ids, mask=inside, other=0.0).to(tl.float64)
            q_ranked = tl.load(q_row + ids, mask=inside, other=0.0).to(tl.float64)
            p_scan = p_run + tl.cumsum(p_ranked, 0)
            q_scan = q_run + tl.cumsum(q_ranked, 0)
            p_below, q_below = p_scan - p_ranked, q_scan - q_ranked
            tl.store(p_below_row + cols, p_below, mask=inside)
            tl.store(q_below_row + cols, q_below, mask=inside)
            ratio = tl.load(ratio_row + cols, mask=inside, other=float("inf")).to(tl.float64)
            before = tl.load(ratio_row + cols - 1, mask=inside & (cols > 0), other=-float("inf"))
            starts = inside & (ratio > before.to(tl.float64))  # j(r_i) = i: a tie's first
            beta_at = (q_total - q_below) / q_total + p_below / ratio
            miss = tl.full([BLOCK], 1.0, tl.float64)
            for i in tl.static_range(K):
                miss = tl.where(i < n, miss * tl.maximum(1 - beta_at, 0.0), miss)
            found = starts & (ratio < nf) & (ratio * beta_at - 1 + miss >= 0)
            at = tl.minimum(at, tl.min(tl.where(found, cols, V), axis=0))
            past = tl.minimum(past, tl.min(tl.where(inside & (ratio >= nf), cols, V), axis=0))
            p_run = tl.max(tl.where(lanes == BLOCK - 1, p_scan, -1.0), axis=0)
            q_run = tl.max(tl.where(lanes == BLOCK - 1, q_scan, -1.0), axis=0)
        tl.debug_barrier()  # other threads of this program read the scratch rows back
        seg = tl.minimum(at, past)  # j of the segment; V: every ratio is below it
        seg_p = tl.where(seg < V, tl.load(p_below_row + tl.minimum(seg, V - 1)), p_run)
        seg_q = tl.where(seg < V, tl.load(q_below_row + tl.minimum(seg, V - 1)), q_run)

        # ρ*: the first probe with f >= 0 among WAYS evenly spaced in [lo, hi], ROUNDS times
        # (kseq_rho_all's search, f from the segment's P and Q)
        ways = tl.arange(0, WAYS)
        lo = zero + 1.0
        hi = nf + zero
        for _ in tl.static_range(ROUNDS):
            rho = lo + (hi - lo) * (ways.to(tl.float64) / WAYS)
            beta_at = (q_total - seg_q) / q_total + seg_p / rho
            miss = tl.full([WAYS], 1.0, tl.float64)
            for i in tl.static_range(K):
                miss = tl.where(i < n, miss * tl.maximum(1 - beta_at, 0.0), miss)
            m = tl.min(tl.where(rho * beta_at - 1 + miss >= 0, ways, WAYS), axis=0)
            lo_next = tl.sum(tl.where(ways == tl.maximum(m - 1, 0), rho, 0.0), axis=0)
            hi = tl.where(m == WAYS, hi, tl.sum(tl.where(ways == m, rho, 0.0), axis=0))
            lo = lo_next
        rho = hi
        # β(ρ*) = Q(ratio >= ρ*)/Q + P(ratio < ρ*)/ρ*, summed in id order (ρ* may lie past
        # the segment), each token's ratio read from the unsorted key
        q_above = tl.zeros([BLOCK], tl.float64)
        p_under = tl.zeros([BLOCK], tl.float64)
        for start in range(0, V, BLOCK):
            cols = start + lanes
            p_id = tl.load(p_row + cols, mask=cols < V, other=0.0).to(tl.float64)
            q_id = tl.load(q_row + cols, mask=cols < V, other=0.0).to(tl.float64)
            key = tl.load(key_row + cols, mask=cols < V, other=float("inf"))
            above = key.to(tl.float64) >= rho
            q_above += tl.where(above, q_id, 0.0)
            p_under += tl.where(above, 0.0, p_id)
        beta = tl.sum(q_above, axis=0) / q_total + tl.sum(p_under, axis=0) / rho

        # the candidates' tests, each with its own uniform: the first that passes is taken
        p_c = tl.load(p_row + cand, mask=in_k, other=0.0).to(tl.float64)
        q_c = tl.load(q_row + cand, mask=in_k, other=0.0).to(tl.float64)
        u_c = tl.load(u_ptr + b * u_s0 + ks * u_s1, mask=in_k, other=1.0).to(tl.float64)
        first = tl.min(tl.where(is_cand & (u_c * rho * q_c < p_c), ks, KP), axis=0)
        token = tl.sum(tl.where(ks == first, cand, 0), axis=0)
        if first == KP:
            # every candidate rejected: draw from p - min(q, p/ρ) (1 - (1-β)^n) / β clamped
            # at 0 (p itself where nothing is left) by its inverse CDF in id order: one pass
            # for the total, one for the first running sum above u times it
            none_pass = zero + 1.0  # (1 - β)^n
            for i in tl.static_range(K):
                none_pass = tl.where(i < n, none_pass * (1 - beta), none_pass)
            scale = (1 - none_pass) / tl.maximum(beta, 1e-300)
            scale = tl.where(beta > 0, scale, 0.0).to(compute)
            rho_c = rho.to(compute)
            residual_sum = tl.zeros([BLOCK], tl.float64)
            p_sum = tl.zeros([BLOCK], tl.float64)
            found = tl.full([BLOCK], V, tl.int32)  # per lane: the first hit's id, V: none
            last = tl.full([BLOCK], -1, tl.int32)  # per lane: the last positive weight's id
            for sweep in tl.static_range(2):
                if sweep == 1:
                    residual_total = tl.sum(residual_sum, axis=0)
                    use_p = residual_total <= 0
                    total = tl.where(use_p, tl.sum(p_sum, axis=0), residual_total)
                    u_draw = tl.load(u_ptr + b * u_s0 + K * u_s1).to(tl.float64)
                    target = tl.minimum(u_draw * total, total * (1 - 2.0**-53))  # < total
                run = zero
                for start in range(0, V, BLOCK):
                    cols = start + lanes
                    inside = cols < V
                    p = tl.load(p_row + cols, mask=inside, other=0.0).to(compute)
                    q = tl.load(q_row + cols, mask=inside, other=0.0).to(compute)
                    w = tl.maximum(p - tl.minimum(q, p / rho_c) * scale, 0.0)
                    if sweep == 0:
                        p_sum += p.to(tl.float64)
                        residual_sum += w.to(tl.float64)
                    else:
                        w = tl.where(use_p, p, w).to(tl.float64)
                        cdf = run + tl.cumsum(w, 0)
                        run = tl.max(tl.where(lanes == BLOCK - 1, cdf, -1.0), axis=0)
                        positive = inside & (w > 0)
                        found = tl.minimum(found, tl.where(positive & (cdf > target), cols, V))
                        last = tl.maximum(last, tl.where(positive, cols, -1))
            # rounding could leave no running sum above the target: then the last weight
            found_id = tl.min(found, axis=0)
            token = tl.where(found_id < V, found_id, tl.max(last, axis=0)).to(tl.int64)
        tl.store(token_ptr + b, token)
        tl.store(rho_ptr + b, rho)
        tl.store(beta_ptr + b, beta)

    return kseq_kernel


def kseq_token(
    p_row: torch.Tensor,  # [B, V]: target rows at the nodes (contiguous along V)
    q_row: torch.Tensor,  # [B, V]: draft rows
    key: torch.Tensor,  # [B, V]: sorting.ratio_key(p, q)
    ratio_sorted: torch.Tensor,  # [B, V]: sorting.sort_ascending(key), the keys
    order: torch.Tensor,  # [B, V] int64: and their token ids
    cand: torch.Tensor,  # [B, K] int64: the node's candidates
    is_cand: torch.Tensor,  # [B, K] bool: the ones that pass through it
    u: torch.Tensor,  # [B, K+1]: the node's uniforms
    search: tuple[int, int],  # (ways, rounds) of the ρ* search, ways a power of two
    block: int | None = None,  # columns per step, KSEQ_BLOCK (tests take small ones)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SpecTr's node rule (top_down.spectr_rule) after the sort, one program per node: the
    segment of sorted ratios that holds ρ*, the ρ* search (kseq_rho_all's grid, f from that
    segment's sums), β(ρ*), the K tests, and where all are rejected the residual draw by
    inverse CDF. -> (token [B] int64, ρ [B], β(ρ) [B] float64). No host reads; one kernel
    where the torch ops launch ~200 a depth."""
    triton, _ = _triton()
    B, V = p_row.shape
    K = cand.shape[1]
    block = block or KSEQ_BLOCK
    ways, rounds = search
    token = torch.empty(B, dtype=torch.int64, device=p_row.device)
    rho = torch.empty(B, dtype=torch.float64, device=p_row.device)
    beta = torch.empty_like(rho)
    below = torch.empty(B, 2, V, dtype=torch.float64, device=p_row.device)
    is_cand = is_cand.to(torch.int8)
    _kseq_kernel()[(B,)](
        p_row,
        q_row,
        key.contiguous(),
        ratio_sorted.contiguous(),
        order.contiguous(),
        cand,
        is_cand,
        u,
        below,
        token,
        rho,
        beta,
        V,
        p_row.stride(0),
        q_row.stride(0),
        cand.stride(0),
        cand.stride(1),
        is_cand.stride(0),
        is_cand.stride(1),
        u.stride(0),
        u.stride(1),
        K=K,
        KP=triton.next_power_of_2(K),
        WAYS=ways,
        ROUNDS=rounds,
        F64=torch.float64 in (p_row.dtype, q_row.dtype),
        BLOCK=block,
        num_warps=min(KSEQ_WARPS, max(1, block // 256)),
    )
    return token, rho, beta
