"""Greedy BV and SpecTr-GBV* as one numba loop a request, for the numba backend (float32 CPU
rows): the K levels, each with its joints, τ_k and M_new of the later paths' rows, then the
draw and the records (sequential_greedy_verify's steps, ~600 dispatched torch ops a call at
K = 4). M_new runs only on rows that are not forced onto A, and τ_k is tested only above |A|.
The sums are float64 in their own order (../cpu_kernels.py says what that can change).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ..cpu_kernels import (
    _JIT_OPTIONS,
    _draw,
    _f32,
    _fma,
    _jit,
    _m_new,
    _row_scalar,
    as_arrays,
    over_requests,
)


@numba.njit(**_JIT_OPTIONS, fastmath={"reassoc"})
def _offset_masses(p, q, t, s):
    """greedy._level_masses of one row: e = (p - t q)_+ - s q in torch's float32 steps, then
    Σ e_+ and Σ (-e)_+ (float64, reassociated) -> float32 each."""
    above, below = 0.0, 0.0
    for v in range(p.shape[0]):
        e = np.float64(_fma(-q[v], s, max(_fma(-q[v], t, p[v]), _f32(0))))
        above += max(e, 0.0)
        below -= min(e, 0.0)
    return _f32(above), _f32(below)


@_jit
def _greedy_tau(p, q, r, k, joint, log_q, t, z, length, u, bound_factor, t_max):
    """greedy._greedy_tau's CPU path for path k of request r under a level's rows t, z [γ]
    with its joints [γ+1], where only a level above |A| = length can change the outcome (A
    grows only if τ_k > |A|; rows below |A| are the forced ones): the levels above |A| that
    can pass, tried top-down, a row's masses summed only when its test is reached. -> τ_k,
    or 0 where no level above |A| passes."""
    gamma = joint.shape[0] - 1
    base = k * gamma - 1  # η_i is u[r, base + i]
    if u[r, base + gamma] < np.exp(min(joint[gamma] - log_q[gamma], 0.0)):
        return gamma
    for i in range(gamma - 1, length, -1):
        log_p = joint[i]
        if not log_p > -np.inf:  # P(X^i) = 0: acceptance 0
            continue
        s = min(z[i] * np.exp(log_q[i] - log_p), t_max)
        eta = u[r, base + i]
        if eta >= z[i] / s * bound_factor:  # above Σm / (s Σq): fails unsummed
            continue
        above, below = _offset_masses(p[r, k, i], q[r, k, i], _row_scalar(t[i]), _row_scalar(s))
        premain, prej = np.float64(above), np.float64(below)
        if eta < (min(premain / prej, 1.0) if prej > 0 else 1.0):
            return i
    return 0


@_jit
def _greedy_verify(
    p, q, tokens, u, t0, z0, bound_factor, t_max, tau, path, y, rec_p, rec_q, lo, hi
):
    """greedy.sequential_greedy_verify for requests lo..hi, one at a time: each level's joints
    on the paths still to test, τ_k of its path, A, then M_new of the later paths' rows (only
    those not forced onto A: a forced row's offsets are never read again); then y ~ P_{K+1}(·|A)
    and each level's record. Writes τ, the path that set A, y, the records' log P [K] and
    log Q."""
    _, K, gamma = tokens.shape
    V = p.shape[3]
    t, z = np.empty((K, gamma)), np.empty((K, gamma))  # the current level's rows
    p_tok, q_tok = np.empty((K, gamma)), np.empty((K, gamma))
    log_q = np.empty((K, gamma + 1))
    joints = np.empty((K, K, gamma + 1))  # [level, path, prefix length]
    accepted = np.empty(gamma, np.int64)
    weights = np.empty(V, np.float32)
    level_t, level_z, level_joint = np.empty(K), np.empty(K), np.empty(K)
    for r in range(lo, hi):
        for j in range(K):
            log_q[j, 0] = 0.0
            for i in range(gamma):
                x = tokens[r, j, i]
                p_tok[j, i], q_tok[j, i] = np.float64(p[r, j, i, x]), np.float64(q[r, j, i, x])
                log_q[j, i + 1] = log_q[j, i] + np.log(q_tok[j, i])
                t[j, i], z[j, i] = t0[r, j, i], z0[r, j, i]
        length, best = 0, 0
        for k in range(K):
            if length == gamma:  # a full block was accepted: later drafts are not tested
                break
            for j in range(k, K):  # level k's joints, one-hot on A below |A|
                joints[k, j, 0] = 0.0
                for i in range(gamma):
                    if i < length:
                        prob = 1.0 if tokens[r, j, i] == accepted[i] else 0.0
                    else:
                        prob = max(p_tok[j, i] - t[j, i] * q_tok[j, i], 0.0) / z[j, i]
                    joints[k, j, i + 1] = joints[k, j, i] + np.log(prob)
            tau_k = _greedy_tau(
                p, q, r, k, joints[k, k], log_q[k], t[k], z[k], length, u, bound_factor, t_max
            )
            if tau_k > length:
                accepted[:] = tokens[r, k]
                length, best = tau_k, k
            for j in range(k + 1, K):  # P_{k+1} = ForcedPrefix(A_k) ∘ M_new(P_k)
                for i in range(length, gamma):
                    t[j, i], z[j, i] = _m_new(
                        p[r, j, i], q[r, j, i], t[j, i], z[j, i], joints[k, j, i], log_q[j, i],
                        t_max,
                    )  # fmt: skip
        # y ~ P_{K+1}(·|A): M_new of each level along A, from the carried row (see greedy.py)
        at = min(length, gamma - 1)
        p_row, q_row = p[r, best, length], q[r, best, at]
        log_q_a = log_q[best, length]
        modifiable = length < gamma  # the bonus row is never modified
        tt, zz = (t0[r, best, at], z0[r, best, at]) if modifiable else (0.0, 1.0)
        for k in range(K):
            joint = joints[k, best, length] if k <= best else 0.0  # A is forced on later levels
            level_t[k], level_z[k], level_joint[k] = tt, zz, joint
            if modifiable:
                tt, zz = _m_new(p_row, q_row, tt, zz, joint, log_q_a, t_max)
        t32, z32 = _row_scalar(tt), _f32(zz)
        for v in range(V):
            weights[v] = max(_fma(-q_row[v], t32, p_row[v]), _f32(0)) / z32
        yr = _draw(weights, u[r, K * gamma])
        tau[r], path[r], y[r] = length, best, yr
        # Record k: the joint of (A, y) under P_k and under the draft
        yv = min(yr, V - 1)
        p_y, q_y = np.float64(p_row[yv]), np.float64(q_row[yv])
        for k in range(K):
            prob = max(p_y - level_t[k] * q_y, 0.0) / level_z[k]
            rec_p[r, k] = level_joint[k] + np.log(prob)
        rec_q[r] = log_q_a + np.log(q_y)


def greedy_verify(
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V] float32
    target_probs: torch.Tensor,  # [B, K, γ+1, V] float32
    uniforms: torch.Tensor,  # [B, Kγ + 1]
    t: torch.Tensor,  # [B, K, γ] float64: the carried rows' offsets (ResidualRows)
    z: torch.Tensor,  # [B, K, γ] float64: their normalisers
    bound_factor: float,  # _greedy_tau's slack on Σm / (s Σq)
    t_max: float,  # modification.T_MAX
) -> tuple[torch.Tensor, ...]:
    """greedy.sequential_greedy_verify as one loop a request: the K levels, each with its
    joints, τ_k and M_new of the later paths' rows, then the draw and the records.
    -> τ [B], path [B], y [B] int64, the records' log P [B, K] and log Q [B] float64."""
    B, K = draft_tokens.shape[:2]
    inputs = as_arrays(
        target_probs, draft_probs, draft_tokens, uniforms.double(), t.double(), z.double()
    )
    tau, path, y = (np.empty(B, np.int64) for _ in range(3))
    rec_p, rec_q = np.empty((B, K)), np.empty(B)
    over_requests(_greedy_verify, B, *inputs, bound_factor, t_max, tau, path, y, rec_p, rec_q)
    return tuple(torch.from_numpy(a) for a in (tau, path, y, rec_p, rec_q))
