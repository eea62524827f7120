"""GBV's Triton kernels: its draft walked in rank order, one program per row (a running sum),
and the q-mass ranked below a drafted token, each row split over programs as in
verification.kernels.row_masses. On CPU the same rules run as numba loops (loops.py); the
reference is in __init__.py."""

from __future__ import annotations

import functools

import torch

from .. import kernels as shared

# GBV's skew walks each row in rank order (a running sum), one program per row.
SKEW_BLOCK = 1024


@functools.cache
def _below_kernel():
    triton, tl = shared._triton()

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
    span, splits = shared.row_chunks(V)
    out = torch.empty(x.shape[0], splits, dtype=torch.float64, device=q.device)
    _below_kernel()[(x.shape[0], splits)](
        key2, q2, x, out, V, span, q2.stride(0), BLOCK=shared.BLOCK, num_warps=8
    )
    return out.sum(1).view(key.shape[:-1])


@functools.cache
def _skew_kernel():
    triton, tl = shared._triton()

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
