"""Fused row passes for CUDA (Triton) that several verifiers share: the residual masses that
most verifiers sum over V.

Per row, block verification's levels need R = Σ_x (p_i p(x) - q(x))_+, traversal's the same
with its budgets α, SpecInfer's rejections and every M_new step F(t) = Σ_x (p(x) - t q(x))_+,
and greedy BV's tests the two halves of e = (p - t q)_+ - s q: Σ e_+ and Σ (-e)_+. In torch
ops that is an addcmul (or mul and sub), a clamp and a sum, each a pass over [rows, V]
(greedy BV: five passes and a temporary; traversal first gathers its path rows). On a GPU such
passes were most of SpecTr-GBV*'s GPU time, so :func:`row_masses` is all of them in one kernel
that reads p and q once, in place (docs/verification_benchmark.md has the current times).

A verifier's own kernels live in its package, beside its reference and its CPU loops: GBV's
rank-order walks in gbv/kernels.py, SpecTr's and SpecInfer's node rules in top_down/kernels.py.

The sums accumulate in float64 (the torch ops sum in the rows' dtype and then widen), and
rows below float32 are computed in float32: the same masses up to rounding, never less
accurate; callers cast them to the torch ops' dtype.
"""

from __future__ import annotations

import functools

import torch

# Columns per program step, and programs per row (rows are few; splitting each row over
# several programs keeps every multiprocessor streaming).
BLOCK = 2048
MAX_SPLITS = 8


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
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: an H100's count, so that tests split rows as a GPU would
