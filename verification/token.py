"""Token verification (Leviathan et al.; Sun et al. Alg. 1, spec §1)."""

from __future__ import annotations

import torch

from .backends import Backend
from .common import emit, positive_part_or, take_rows
from .tensors import sample_from_weights


def num_uniforms(k: int, gamma: int) -> int:
    return gamma + 1  # one accept test per position, one for the recovered/bonus sample


def token_verify_rows(
    x: torch.Tensor,  # [B, γ] int64: the path
    q: torch.Tensor,  # [B, γ, V]: draft rows the path was sampled from
    p: torch.Tensor,  # [B, γ+1, V]: target rows
    tests: torch.Tensor,  # [B, γ] float64: the accept test's uniform at each position
    draws: torch.Tensor,  # [B, γ+1] float64: the recovered/bonus draw's uniform, by τ
):
    """TV on one path per request; returns (τ [B], y [B]). SpecInfer and SpecTr, TV along one
    path (spec §6, §7), read the walk's uniforms instead: top_down._token_from."""
    gamma = x.shape[1]
    px = p[:, :gamma].gather(-1, x.unsqueeze(-1)).squeeze(-1)  # [B, γ]
    qx = q.gather(-1, x.unsqueeze(-1)).squeeze(-1)  # [B, γ]
    tau = accepted_length(px, qx, tests)
    p_row = take_rows(p, tau)  # [B, V]
    q_row = take_rows(q, tau.clamp_max(gamma - 1)) * (tau < gamma).unsqueeze(-1)  # q := 0 at γ
    return tau, recovered_token(p_row, q_row, take_rows(draws, tau))


def accepted_length(
    px: torch.Tensor,  # [B, L]: p of each path token
    qx: torch.Tensor,  # [B, L]: q of each path token
    tests: torch.Tensor,  # [B, L] float64: the accept test's uniform at each position
) -> torch.Tensor:
    """τ [B]: how many tokens pass u < p/q before the first that does not."""
    return (tests * qx < px).long().cumprod(-1).sum(-1)  # u < p/q without dividing


def recovered_token(
    p_row: torch.Tensor,  # [B, V]: the target row after the accepted prefix
    q_row: torch.Tensor,  # [B, V]: its draft row, zeros after a full block (bonus)
    u: torch.Tensor,  # [B]
) -> torch.Tensor:
    """y ~ (p - q)_+ normalised (p itself where nothing is left): the recovered or bonus token."""
    return sample_from_weights(positive_part_or(p_row - q_row, p_row), u)


def token_verify(
    backend: Backend,  # every backend runs these ops: reading no value, they skip nothing
    draft_tokens: torch.Tensor,  # [B, 1, γ] int64
    draft_probs: torch.Tensor,  # [B, 1, γ, V]
    target_probs: torch.Tensor,  # [B, 1, γ+1, V]
    uniforms: torch.Tensor,  # [B, γ+1] float64
):
    """Accept X_i w.p. min(1, p/q) until the first rejection; recover from (p - q)_+."""
    x, gamma = draft_tokens[:, 0], draft_tokens.shape[2]
    draws = uniforms[:, gamma:].expand(-1, gamma + 1)  # one draw, whichever τ
    tau, y = token_verify_rows(x, draft_probs[:, 0], target_probs[:, 0], uniforms[:, :gamma], draws)
    return emit(x, tau, y), tau, torch.zeros_like(tau)
