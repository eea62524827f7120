"""Block verification (Sun et al., ICLR'25, Alg. 2, Eqs. 4-5; spec §2)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import kernels
from ..backends import Backend
from ..common import (
    ROW_SUM_TOL,
    clipped_products,
    emit,
    last_passing_level,
    over_batch_chunks,
    positive_part_or,
    take_rows,
)
from ..tensors import sample_from_weights
from . import loops


def num_uniforms(k: int, gamma: int) -> int:
    return gamma + 1  # one η per level, one for the recovered/bonus sample


def block_verify_rows(
    backend: Backend,
    x: torch.Tensor,  # [B, γ] int64: the path
    q: torch.Tensor,  # [B, γ, V]: draft rows the path was sampled from
    p: torch.Tensor,  # [B, γ+1, V]: target rows
    uniforms: torch.Tensor,  # [B, γ+1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """BV on one path per request; returns (τ [B], emitted y [B]). Shared with GBV at K = 1
    and traversal on a chain. On the numba backend one loop a request
    (loops.block_verify), the masses summed only where a uniform can reach, top-down
    (levels_top_down): the same τ and y as the torch ops (block_verify_torch_rows)."""
    if backend.compiled_loops:
        return loops.block_verify(x, q, p, uniforms, reach_slack(p.dtype))
    return block_verify_torch_rows(backend, x, q, p, uniforms)


def block_verify_torch_rows(
    backend: Backend,
    x: torch.Tensor,  # [B, γ] int64: the path
    q: torch.Tensor,  # [B, γ, V]: draft rows the path was sampled from (GBV: q̃)
    p: torch.Tensor,  # [B, γ+1, V]: target rows
    uniforms: torch.Tensor,  # [B, γ+1]
    q_drafted: torch.Tensor | None = None,  # [B, γ]: q(x_i); gathered from q when None
) -> tuple[torch.Tensor, torch.Tensor]:
    """block_verify_rows in torch ops, every level's mass in one batched pass."""
    gamma = x.shape[1]
    qx = q.gather(-1, x.unsqueeze(-1)).squeeze(-1) if q_drafted is None else q_drafted
    pi = running_products(p[:, :gamma].gather(-1, x.unsqueeze(-1)).squeeze(-1), qx, p.dtype)
    # R_i = Σ_x (p_i p(x|X^i) - q(x|X^i))_+ for i = 1..γ-1, in one batched pass: summing only
    # the levels a uniform can reach (levels_top_down) was not faster on CPU.
    mass = over_batch_chunks(residual_mass, backend, p[:, 1:gamma], q[:, 1:], pi[:, :-1])
    tau = block_tau(pi, mass, uniforms)
    q_row = take_rows(q, tau.clamp_max(gamma - 1)) * (tau < gamma).unsqueeze(-1)
    return tau, residual_token(pi, tau, take_rows(p, tau), q_row, uniforms[:, gamma])


def block_tau(
    pi: torch.Tensor,  # [B, γ]: the running products p_1..p_γ
    mass: torch.Tensor,  # [B, γ-1]: the residual masses R_1..R_{γ-1}
    uniforms: torch.Tensor,  # [B, ≥γ]: η_1..η_γ first
) -> torch.Tensor:
    """Block verification's τ [B]: the highest level i whose η_i < h_i (h_γ = p_γ; level 0
    always passes)."""
    gamma = pi.shape[1]
    h = torch.cat([level_probs(mass, pi[:, :-1]), pi[:, -1:]], dim=1)
    return last_passing_level(uniforms[:, :gamma].to(h.dtype), h)  # independent η_i, no break


def levels_top_down(
    pi: torch.Tensor,  # [B, γ]: the running products p_1..p_γ
    eta: torch.Tensor,  # [B, γ] float64: η_1..η_γ
    q_row: torch.Tensor,  # [B, V] zeros: receives the draft row after the accepted prefix
    rows_at: Callable,  # (requests [m], levels [m]) -> (draft rows, target rows) [m, V] each
    backend: Backend,  # one that reads the host
) -> torch.Tensor:
    """τ [B] of block verification, its residual masses summed only where a level can pass.

    Level i < γ passes with h_i = R_i / (R_i + 1 - p_i) <= p_i Σp, as R_i = Σ(p_i p - q)_+ <=
    p_i Σp, so where η_i >= p_i Σp it fails without its row; and τ is the highest passing
    level, so the levels are tried top-down, one round per level for every request still
    undecided, stopping at the first pass, whose draft row goes into q_row (level 0, τ = 0,
    always passes). Host backends only (each round reads which requests go on). It pays
    where a row is expensive to build, as GBV's skewed draft (rows_at ranks it); plain rows
    are cheaper in one batched pass (block_verify_torch_rows). The same τ as that pass: the
    same masses, and η compared in the dtype of h (the rows' promoted dtype)."""
    gamma = pi.shape[1]
    rows_dtype = torch.promote_types(q_row.dtype, pi.dtype)
    eta = eta.to(rows_dtype)
    tau = torch.where(eta[:, -1] < pi[:, -1], gamma, -1)  # h_γ = p_γ; -1: not decided yet
    # Levels 0..γ-1, with p_0 = 1; level 0 (τ = 0) always passes.
    pi_lvl = torch.cat([torch.ones_like(pi[:, :1]), pi[:, :-1]], dim=1)
    eta_lvl = torch.cat([torch.zeros_like(eta[:, :1]), eta[:, :-1]], dim=1)
    slack = reach_slack(pi.dtype)
    reach = (eta_lvl.double() < pi_lvl.double() * slack) & (tau < 0).unsqueeze(-1)  # [B, γ]
    levels = torch.arange(gamma, device=pi.device)
    while bool(reach.any()):
        rows = reach.any(-1).nonzero().squeeze(-1)  # [m]
        level = torch.where(reach[rows], levels, 0).amax(-1)  # the highest one left: [m]
        q_at, p_at = rows_at(rows, level)
        pi_at = pi_lvl[rows, level]
        h = level_probs(residual_mass(backend, p_at, q_at, pi_at), pi_at)
        passed = (eta_lvl[rows, level] < h) | (level == 0)
        won = passed.nonzero().squeeze(-1)  # [w]: positions in rows
        reach[rows, level] = False
        reach[rows[won]] = False
        tau[rows[won]], q_row[rows[won]] = level[won], q_at[won]
    return tau


def reach_slack(dtype: torch.dtype) -> float:
    """Level i can pass only where η_i < p_i Σp, and Σp <= this: rows sum to 1 within
    ROW_SUM_TOL, and the rest covers rounding h and p_i in ``dtype``."""
    return 1 + ROW_SUM_TOL + 8 * torch.finfo(dtype).eps


def running_products(
    px: torch.Tensor,  # [B, γ]: p(X_i), the target's probability of each path token
    qx: torch.Tensor,  # [B, γ]: q(X_i)
    dtype: torch.dtype,  # the rows'
) -> torch.Tensor:
    """p_i = min(1, p_{i-1} p(X_i)/q(X_i)), i = 1..γ: [B, γ]. The clip applies to the running
    product (not per factor, which is the lossy vLLM-Ascend #7807 bug class)."""
    return clipped_products(px.log() - qx.log()).exp().to(dtype)


def residual_mass(
    backend: Backend,
    p: torch.Tensor,  # [..., V]: target rows
    q: torch.Tensor,  # [..., V]: draft rows
    pi: torch.Tensor,  # [...]: the running product at each row
) -> torch.Tensor:
    """R = Σ_x (p_i p(x) - q(x))_+ = -Σ_x (q - p_i p)_-: [...], two passes and one temporary
    (on CUDA one fused pass)."""
    if backend.fuses(p, q):
        dtype = torch.promote_types(torch.promote_types(q.dtype, p.dtype), pi.dtype)
        return kernels.excess_mass(p, q, pi).to(dtype)
    return torch.addcmul(q, p, pi.unsqueeze(-1), value=-1).clamp_max_(0).sum(-1).neg()


def level_probs(mass: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """h_i = R_i / (R_i + 1 - p_i), the chance that level i passes (0/0 -> 1, spec §11)."""
    denom = mass + 1 - pi
    return torch.where(denom > 0, mass / denom.clamp_min(1e-300), 1.0)


def residual_token(
    pi: torch.Tensor,  # [B, γ]: the running products p_1..p_γ
    tau: torch.Tensor,  # [B] int64: the accepted length
    p_row: torch.Tensor,  # [B, V]: the target row after the accepted prefix
    q_row: torch.Tensor,  # [B, V]: its draft row, zeros where τ = γ
    u: torch.Tensor,  # [B]
) -> torch.Tensor:
    """The recovered (τ < γ) or bonus (τ = γ) token: y ~ (p_τ p - q)_+ normalised, p_0 = 1."""
    pi_tau = take_rows(torch.cat([torch.ones_like(pi[:, :1]), pi], dim=1), tau)
    weights = pi_tau.unsqueeze(-1) * p_row - q_row
    return sample_from_weights(positive_part_or(weights, p_row), u)


def block_verify(
    backend: Backend,
    draft_tokens: torch.Tensor,  # [B, 1, γ] int64
    draft_probs: torch.Tensor,  # [B, 1, γ, V]
    target_probs: torch.Tensor,  # [B, 1, γ+1, V]
    uniforms: torch.Tensor,  # [B, γ+1]
):
    """Block verification of the one path: -> (tokens, τ, path)."""
    x = draft_tokens[:, 0]
    tau, y = block_verify_rows(backend, x, draft_probs[:, 0], target_probs[:, 0], uniforms)
    return emit(x, tau, y), tau, torch.zeros_like(tau)
