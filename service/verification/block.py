"""Block verification (Sun et al., ICLR'25, Alg. 2, Eqs. 4-5; spec §2)."""

from __future__ import annotations

import torch

from workers.sampling import sample_from_weights

from .common import (
    clipped_products,
    emit,
    last_passing_level,
    over_batch_chunks,
    positive_part_or,
    take_rows,
)


def num_uniforms(k: int, gamma: int) -> int:
    return gamma + 1  # one η per level, one for the recovered/bonus sample


def block_verify_rows(
    x: torch.Tensor,  # [B, γ] int64: the path
    q: torch.Tensor,  # [B, γ, V]: draft rows the path was sampled from
    p: torch.Tensor,  # [B, γ+1, V]: target rows
    uniforms: torch.Tensor,  # [B, γ+1]
    q_drafted: torch.Tensor | None = None,  # [B, γ]: q(x_i); gathered from q when None
):
    """BV on one path per request; returns (τ [B], emitted y [B]). Shared with GBV (§8)."""
    gamma = x.shape[1]
    px = p[:, :gamma].gather(-1, x.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, x.unsqueeze(-1)).squeeze(-1) if q_drafted is None else q_drafted
    # p_i = min(1, p_{i-1} p(X_i)/q(X_i)): the clip applies to the running product (not per
    # factor, which is the lossy vLLM-Ascend #7807 bug class).
    log_pi = clipped_products(px.log() - qx.log())  # [B, γ], i = 1..γ
    pi = log_pi.exp().to(p.dtype)
    pi_all = torch.cat([torch.ones_like(pi[:, :1]), pi], dim=1)  # [B, γ+1], p_0 = 1

    # R_i = Σ_x (p_i p(x|X^i) - q(x|X^i))_+ for i = 1..γ-1; h_i = R_i / (R_i + 1 - p_i).

    def mass(p, q, pi):  # Σ_x (pi p - q)_+ = -Σ_x (q - pi p)_-, two passes and one temporary
        return torch.addcmul(q, p, pi.unsqueeze(-1), value=-1).clamp_max_(0).sum(-1).neg()

    residual_mass = over_batch_chunks(mass, p[:, 1:gamma], q[:, 1:], pi[:, :-1])
    denom = residual_mass + 1 - pi[:, :-1]
    h = torch.where(denom > 0, residual_mass / denom.clamp_min(1e-300), 1.0)  # 0/0 -> 1 (§11)
    h = torch.cat([h, pi[:, -1:]], dim=1)  # h_γ = p_γ
    tau = last_passing_level(uniforms[:, :gamma].to(h.dtype), h)  # independent η_i, no break

    p_row = take_rows(p, tau)
    q_row = take_rows(q, tau.clamp_max(gamma - 1)) * (tau < gamma).unsqueeze(-1)
    weights = take_rows(pi_all, tau).unsqueeze(-1) * p_row - q_row
    y = sample_from_weights(positive_part_or(weights, p_row), uniforms[:, gamma])
    return tau, y


def block_verify(
    draft_tokens: torch.Tensor,  # [B, 1, γ] int64
    draft_probs: torch.Tensor,  # [B, 1, γ, V]
    target_probs: torch.Tensor,  # [B, 1, γ+1, V]
    uniforms: torch.Tensor,  # [B, γ+1]
):
    x = draft_tokens[:, 0]
    tau, y = block_verify_rows(x, draft_probs[:, 0], target_probs[:, 0], uniforms)
    return emit(x, tau, y), tau, torch.zeros_like(tau)
