"""Traversal verification's walk as one numba loop a request, for the numba backend (float32
CPU rows): the same segments as traversal_verify's batched torch ops (~80 dispatched ops a
segment and several passes over γ rows), with each node's mass summed only when its test is
reached, reading each row it tests once. Its sums are float64 where torch's are float32: a
test or a draw whose uniform lies within ~1e-7 (relative) of its threshold could go the
other way, nothing else differs.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ..cpu_kernels import (
    _JIT_OPTIONS,
    _draw,
    _f32,
    _jit,
    as_arrays,
    over_requests,
)


@numba.njit(**_JIT_OPTIONS, fastmath={"reassoc"})
def _excess_mass(p, q, alpha):
    """float32 Σ_v (α p[v] - q[v])_+, the products and differences in float32 as torch's
    ops, summed in float64 (reassociated, so vectorised)."""
    total = 0.0
    for v in range(p.shape[0]):
        total += max(np.float64(alpha * p[v] - q[v]), 0.0)
    return _f32(total)


@_jit
def _clipped_log_alpha(log_alpha, ratio, first_edge, u, log_start):
    """common.clipped_products below depth u: log α at levels u+1..γ of a path whose first
    edge below u is first_edge and the rest its original log ratios (float64, in order)."""
    running = 0.0
    peak = -np.inf
    for d in range(u, ratio.shape[0]):
        running += first_edge if d == u else ratio[d]
        s = running + log_start
        if s >= peak or s != s:  # torch's cummax: NaN propagates
            peak = s
        log_alpha[d + 1] = s - (peak if (peak > 0 or peak != peak) else 0.0)


@_jit
def _traversal_walk(p, q, tokens, leaves, branch, log_ratio, u, tau, path_out, y, lo, hi):
    """traversal.traversal_verify's walk for requests lo..hi, one at a time: its segments
    tested top-down, each node's mass summed only when its test is reached (the deepest
    pass wins, so the first from the top does), and only the branch node's rows rewritten.
    Writes τ, the final path and y."""
    _, K, gamma = tokens.shape
    V = p.shape[3]
    mod_p = np.empty((gamma, V), np.float32)  # the rows deletions rewrote, by depth
    mod_q = np.empty((gamma, V), np.float32)
    row = np.empty(V, np.float32)  # norm((α p - q)_+) of the accepted node
    modified = np.zeros(gamma, np.bool_)
    log_alpha = np.zeros(gamma + 1)
    one = _f32(1)
    for r in range(lo, hi):
        modified[:] = False
        tests = 0
        path = leaves[r, 0]
        log_alpha[0] = 0.0
        _clipped_log_alpha(log_alpha, log_ratio[r, path], log_ratio[r, path, 0], 0, 0.0)
        for leaf in range(K):  # one segment per distinct leaf, as traversal_verify
            b = branch[r, leaf]
            # Tests from the leaf up to depth b + 1, then (if none passed) the update of b.
            depth, d = -1, gamma
            alpha, mass, new_log_alpha = one, _f32(0), 0.0
            p_row, q_row = p[r, path, 0], q[r, path, 0]  # (typed here; read where set below)
            while d >= max(b, 0):
                if d < gamma:
                    p_row = mod_p[d] if modified[d] else p[r, path, d]
                    q_row = mod_q[d] if modified[d] else q[r, path, d]
                    alpha = _f32(np.exp(log_alpha[d]))
                    mass = _excess_mass(p_row, q_row, alpha)
                    denom = mass + one - alpha
                    new_alpha = min(mass / denom, one) if denom > 0 else one
                    new_log_alpha = np.log(np.float64(new_alpha))
                if d == b:
                    break
                test_log_alpha = log_alpha[gamma] if d == gamma else new_log_alpha
                if np.log(u[r, min(max(tests + gamma - d, 0), K * gamma)]) < test_log_alpha:
                    depth = d
                    break
                d -= 1
            if depth == gamma:
                y[r] = _draw(p[r, path, gamma], u[r, K * gamma + 1])
            elif depth >= 0:  # the updated row norm((α p - q)_+) (p if 0/0)
                for v in range(V):
                    excess = max(alpha * p_row[v] - q_row[v], _f32(0))
                    row[v] = excess / mass if mass > 0 else p_row[v]
                y[r] = _draw(row, u[r, K * gamma + 1])
            if depth >= 0:
                tau[r], path_out[r] = depth, path
                break
            # Not accepted: everything below b is deleted. b keeps its updated rows, q without
            # the deleted child's token, renormalised; the walk moves to the next leaf.
            tok = tokens[r, path, b]
            q_mass = 0.0
            for v in range(V):
                pv, qv = p_row[v], q_row[v]
                mod_p[b, v] = max(alpha * pv - qv, _f32(0)) / mass if mass > 0 else pv
                mod_q[b, v] = qv if v != tok else _f32(0)
                q_mass += np.float64(mod_q[b, v])
            if _f32(q_mass) > 0:
                mod_q[b] /= _f32(q_mass)
            tests += gamma - b
            modified[b] = True
            modified[b + 1 :] = False
            log_alpha[b] = new_log_alpha
            path = leaves[r, leaf + 1]
            new_tok = tokens[r, path, b]
            first_edge = np.float64(np.log(mod_p[b, new_tok]) - np.log(mod_q[b, new_tok]))
            _clipped_log_alpha(log_alpha, log_ratio[r, path], first_edge, b, new_log_alpha)


def traversal_walk(
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V] float32
    target_probs: torch.Tensor,  # [B, K, γ+1, V] float32
    leaves: torch.Tensor,  # [B, K] int64: path ids in post-order (traversal._leaf_order)
    branch: torch.Tensor,  # [B, K] int64: where each leaf branches off the next, -1 last
    log_ratio: torch.Tensor,  # [B, K, γ] float64: log p/q of each drafted token
    uniforms: torch.Tensor,  # [B, Kγ + 2]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """traversal_verify's walk as one loop a request. -> τ [B], path [B], y [B] int64."""
    B = draft_probs.shape[0]
    tau, path, y = (np.empty(B, np.int64) for _ in range(3))
    inputs = as_arrays(target_probs, draft_probs, draft_tokens, leaves, branch, log_ratio, uniforms)
    over_requests(_traversal_walk, B, *inputs, tau, path, y)
    return torch.from_numpy(tau), torch.from_numpy(path), torch.from_numpy(y)
