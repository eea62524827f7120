"""Block verification as one numba loop a request, for the numba backend (float32 CPU rows):
block_verify_rows' levels, their residual masses summed only where a uniform can reach,
top-down (block.levels_top_down), then the residual draw. The same τ and y as the torch ops;
the sums are float64 in their own order (../cpu_kernels.py says what that can change).
"""

from __future__ import annotations

import numpy as np
import torch

from ..cpu_kernels import (
    _jit,
    _level_prob,
    _next_level,
    _product_before,
    _residual_draw,
    _residual_mass,
    _running_products,
    _top_level,
    as_arrays,
    over_requests,
)


@_jit
def _block_verify(p, q, tokens, eta, u, slack, pi, tau, y, lo, hi):
    """block.block_verify_rows for requests lo..hi, one at a time: the running products, the
    levels that can pass tried top-down (levels_top_down: a row's residual mass summed only
    when its test is reached), then y from the row τ stopped at (q is 0 there at τ = γ)."""
    gamma = tokens.shape[1]
    V = p.shape[2]
    p_x, q_x = np.empty(gamma, np.float32), np.empty(gamma, np.float32)
    no_draft = np.zeros(V, np.float32)  # the draft row at τ = γ: the bonus token
    weights = np.empty(V, np.float32)
    for r in range(lo, hi):
        for d in range(gamma):
            x = tokens[r, d]
            p_x[d], q_x[d] = p[r, d, x], q[r, d, x]
        _running_products(p_x, q_x, pi[r])
        level = _top_level(eta[r], pi[r], slack)
        while level < gamma:
            pi_lvl = _product_before(pi[r], level)
            h = _level_prob(_residual_mass(p[r, level], q[r, level], pi_lvl), pi_lvl)
            if level == 0 or eta[r, level - 1] < h:
                break
            level = _next_level(eta[r], pi[r], slack, level)
        tau[r] = level
        q_row = q[r, level] if level < gamma else no_draft
        y[r] = _residual_draw(p[r, level], q_row, _product_before(pi[r], level), u[r], weights)


def block_verify(
    x: torch.Tensor,  # [B, γ] int64: the path
    q: torch.Tensor,  # [B, γ, V] float32
    p: torch.Tensor,  # [B, γ+1, V] float32
    uniforms: torch.Tensor,  # [B, γ+1]
    slack: float,  # levels_top_down's bound on h_i / p_i
) -> tuple[torch.Tensor, torch.Tensor]:
    """block.block_verify_rows as one loop a request, the residual masses summed only at the
    levels its uniforms reach, top-down. -> τ [B], y [B] int64."""
    B, gamma = x.shape
    tokens, q_np, p_np = as_arrays(x, q, p)
    eta = uniforms[:, :gamma].float().numpy()  # compared in the rows' dtype, as the torch ops
    u = uniforms[:, gamma].double().numpy()
    pi = np.empty((B, gamma), np.float32)
    tau, y = np.empty(B, np.int64), np.empty(B, np.int64)
    over_requests(_block_verify, B, p_np, q_np, tokens, eta, u, slack, pi, tau, y)
    return torch.from_numpy(tau), torch.from_numpy(y)
