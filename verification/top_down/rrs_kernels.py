"""SpecInfer's node rule on CUDA (kernels.rrs_token launches these): top_down.specinfer_rule's
closed form r_j = (p - t_j q)_+ / z_j as one kernel per level j = 1..K, whose programs each sum
(p - t_j q)_+ over a chunk of the row (t_1 = 1, t_{j+1} = t_j + z_j: the levels are
sequential); then the K tests and, where every candidate is rejected, the chunk masses of the
residual at level n_v; then its inverse-CDF draw (spectr_kernels.draw_residual). K + 2 kernels
a node where the torch ops take ~60, and no host reads.

Every program of a row settles the levels' (t, z) from the same chunk sums in the same order,
so all of them hold the same bits. Imported only where Triton is installed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .spectr_kernels import (
    candidates,
    chunk_masses,
    draw_residual,
    first_passing,
    node_count,
    pick,
    store_chunk_masses,
)


@triton.jit
def settle(level_row, j, S, SP: tl.constexpr, t, z):
    """(t, z) of level j from level j - 1's (t, z) and level j's chunk sums: a level with no
    mass left keeps the one before (specinfer_rule's `empty`)."""
    chunks = tl.arange(0, SP)
    mass = tl.sum(tl.load(level_row + j * S + chunks, mask=chunks < S, other=0.0), axis=0)
    keep = mass <= 0
    return tl.where(keep, t, t + z), tl.where(keep, z, mass)


@triton.jit
def level_kernel(
    p_ptr,  # [B, V]: target rows by id (row stride p_s0)
    q_ptr,  # [B, V]: draft rows by id (row stride q_s0)
    is_cand_ptr,  # [B, K] int8: the candidates that pass through the node
    level_ptr,  # [B, K + 1, S] float64 in/out: chunk sums of (p - t_j q)_+, level 0 unused
    level,  # j >= 1: this kernel's level
    V,
    p_s0,
    q_s0,
    i_s0,
    i_s1,
    S,  # programs (chunks) per row
    CHUNK,  # columns per chunk, a multiple of BLOCK
    max_scalar,  # as_row_scalars' clamp for the rows' dtype
    K: tl.constexpr,
    KP: tl.constexpr,
    SP: tl.constexpr,
    F64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    level_row = level_ptr + b * (K + 1) * S
    t = tl.full([], 0.0, tl.float64)  # level 0: r_0 = p
    z = tl.full([], 1.0, tl.float64)
    for j in range(1, level):
        t, z = settle(level_row, j, S, SP, t, z)
    compute = tl.float64 if F64 else tl.float32
    t_next = tl.minimum(t + z, max_scalar).to(compute)
    # A node with n candidates reads levels 1..n only (its tests those below n, its draw t_n,
    # which level n's mass settles): above n the row is not read, and its sum stays 0. Most
    # nodes below where the paths part have one candidate: one pass instead of K.
    n = node_count(is_cand_ptr, b, i_s0, i_s1, K, KP)
    span = CHUNK * (level <= n).to(tl.int32)
    # Σ (p - t q)_+ over the chunk, the value kernels.row_masses sums (the same chunks)
    mass, _ = chunk_masses(
        p_ptr + b * p_s0, q_ptr + b * q_s0, t_next, t_next, V, span, False, compute, BLOCK
    )
    tl.store(level_row + level * S + s, mass)


@triton.jit
def tests_kernel(
    p_ptr,
    q_ptr,
    cand_ptr,  # [B, K] int64: the candidates, in path order
    is_cand_ptr,  # [B, K] int8: the ones that pass through the node
    u_ptr,  # [B, K+1]: a uniform per candidate test, then one for the residual draw
    level_ptr,  # [B, K + 1, S] float64: level_kernel's chunk sums
    mass_ptr,  # [B, S, 2] float64 out: per chunk, the residual's mass and p's
    token_ptr,  # [B] int64 out: the accepted candidate, -1 where all are rejected
    t_ptr,  # [B] float64 out: t of the residual drawn from where all are rejected
    V,
    p_s0,
    q_s0,
    c_s0,
    c_s1,
    i_s0,
    i_s1,
    u_s0,
    u_s1,
    S,
    CHUNK,
    max_scalar,
    K: tl.constexpr,
    KP: tl.constexpr,
    LP: tl.constexpr,  # a power of two above K: one lane per level 0..K
    SP: tl.constexpr,
    F64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    level_row = level_ptr + b * (K + 1) * S
    lanes = tl.arange(0, LP)
    t = tl.full([], 0.0, tl.float64)
    z = tl.full([], 1.0, tl.float64)
    t_at = tl.zeros([LP], tl.float64)  # t_j, z_j by level
    z_at = tl.full([LP], 1.0, tl.float64)
    for j in tl.static_range(1, K + 1):
        t, z = settle(level_row, j, S, SP, t, z)
        t_at = tl.where(lanes == j, t, t_at)
        z_at = tl.where(lanes == j, z, z_at)
    # Candidate k is tested at the level of the candidates before it (its rejections so far)
    # against r = (p - t q)_+ / z: u q < r(x), as specinfer_rule's tests(). The rows' values
    # are exact in float64 and in the compute dtype alike.
    p_row = p_ptr + b * p_s0
    q_row = q_ptr + b * q_s0
    ks, cand, is_cand, p_c, q_c, u_c = candidates(
        p_row, q_row, cand_ptr, is_cand_ptr, u_ptr, b, c_s0, c_s1, i_s0, i_s1, u_s0, u_s1, K, KP
    )
    before = tl.cumsum(is_cand.to(tl.int32), 0) - is_cand.to(tl.int32)  # [KP]
    at_level = before[:, None] == lanes[None, :]  # [KP, LP]
    t_c = tl.sum(tl.where(at_level, t_at[None, :], 0.0), axis=1)
    z_c = tl.sum(tl.where(at_level, z_at[None, :], 0.0), axis=1)
    residual = tl.maximum(p_c - t_c * q_c, 0.0) / z_c
    first, token = first_passing(is_cand & (u_c * q_c < residual), ks, cand, KP)
    t_draw = pick(t_at, lanes, node_count(is_cand_ptr, b, i_s0, i_s1, K, KP))
    if s == 0:
        tl.store(token_ptr + b, token)
        tl.store(t_ptr + b, t_draw)
    if first == KP:
        # every candidate rejected: this chunk's mass of level n_v's (p - t q)_+, and of p
        # (drawn from where nothing is left)
        compute = tl.float64 if F64 else tl.float32
        t_r = tl.minimum(t_draw, max_scalar).to(compute)
        mass_out = mass_ptr + (b * S + s) * 2
        store_chunk_masses(p_row, q_row, mass_out, t_r, t_r, V, CHUNK, False, compute, BLOCK)


@triton.jit
def draw_kernel(
    p_ptr,
    q_ptr,
    u_ptr,
    mass_ptr,  # [B, S, 2] float64: tests_kernel's chunk masses
    token_ptr,  # [B] int64 in/out: -1 becomes the residual's draw
    t_ptr,  # [B] float64: tests_kernel's t of the residual
    V,
    p_s0,
    q_s0,
    u_s0,
    u_s1,
    S,
    CHUNK,
    max_scalar,
    K: tl.constexpr,
    SP: tl.constexpr,
    F64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The residual's draw where every candidate was rejected (draw_residual)."""
    b = tl.program_id(0).to(tl.int64)
    if tl.load(token_ptr + b) < 0:
        compute = tl.float64 if F64 else tl.float32
        t_r = tl.minimum(tl.load(t_ptr + b), max_scalar).to(compute)
        u_draw = tl.load(u_ptr + b * u_s0 + K * u_s1).to(tl.float64)
        draw_residual(
            p_ptr + b * p_s0, q_ptr + b * q_s0, mass_ptr + b * S * 2, token_ptr + b, u_draw,
            t_r, t_r, V, S, CHUNK, False, SP, compute, BLOCK,
        )  # fmt: skip
