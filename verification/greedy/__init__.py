"""Greedy block verification (Sun et al. App. C, Alg. 4-6; spec §3) and SpecTr-GBV* (spec §10).

SpecTr-GBV* is the spec's reconstruction of Lin et al. (arXiv 2604.25925), whose equations were
lost: sequential greedy BV over the K drafts with a carried law. With P_1 the target,

    for k = 1..K:  τ_k = greedy BV of draft k against P_k (joints from the iteration start);
                   A_k = the longer of A_{k-1} and X_k^{τ_k} (one is a prefix of the other);
                   P_{k+1} = ForcedPrefix(A_k) ∘ M_new(P_k)   on relative lengths τ_k..γ-1;
                   stop early once |A_k| = γ;
    emit A, then y ~ P_{K+1}(· | A);  carry P_{K+1} (K modification records) forward.

Greedy BV is exactly the K = 1 case (spec §10 [CHK]), so both share this code. Each level's
rows along a path only depend on the path's prefix, which keeps "identical prefixes have
identical rows" true at every level.

On the numba backend the whole call is one loop a request (greedy_verify_loops): the same
levels, with M_new only on rows that are not forced onto A (a forced row's offsets are never
read again) and τ_k tested only above |A| (a level at or below |A| cannot lengthen A). The
torch ops below (sequential_greedy_verify) are the other backends' path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..backends import Backend
from ..common import (
    ROW_SUM_TOL,
    emit,
    exclusive_cumsum,
    last_passing_level,
    over_batch_chunks,
    take_rows,
)
from ..modification import (
    T_MAX,
    ResidualRows,
    as_row_scalars,
    m_new,
    residual_prob,
    residual_weights,
)
from ..tensors import rows_at, sample_from_weights
from . import loops


def num_uniforms(k: int, gamma: int) -> int:
    return k * gamma + 1  # one η per level per draft, one for the recovered/bonus sample


def _path_logp(
    p_tok: torch.Tensor,  # [B, P, γ] float64: p of each path token (base rows)
    q_tok: torch.Tensor,  # [B, P, γ] float64
    rows: ResidualRows,  # [B, P, γ]: the level's rows where not forced
    tokens: torch.Tensor,  # [B, P, γ] int64
    accepted: torch.Tensor,  # [B, γ] int64: forced prefix A (first `length` entries)
    forced: torch.Tensor | None,  # [B, γ] bool: lengths < |A|; None: A is empty (level 0)
) -> torch.Tensor:
    """log joint of every prefix of each path under a level's law: [B, P, γ+1] float64.

    Rows at prefix lengths < |A| are one-hot on A (ForcedPrefix): probability 1 on A's token,
    0 off it; the others are (p - t q)_+ / z (p itself on unmodified rows, bit for bit).
    """
    prob = p_tok if rows.unmodified else residual_prob(p_tok, q_tok, rows.t, rows.z)
    if forced is not None:
        on_a = (tokens == accepted[:, None, :]).double()
        prob = torch.where(forced[:, None, :], on_a, prob)
    return exclusive_cumsum(prob.log())


def _level_masses(
    backend: Backend,
    p: torch.Tensor,  # [..., V]: base target rows
    q: torch.Tensor,  # [..., V]
    t: torch.Tensor,  # [...] float64: the rows' offsets (ResidualRows.t)
    s: torch.Tensor,  # [...] float64: z Q(X^i) / P(X^i)
    unmodified: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """premain ∝ Σ(m - s q)_+ and prej ∝ Σ(s q - m)_+ with m = (p - t q)_+, float64 [...]."""
    if backend.fuses(p, q):  # CUDA: one fused pass for both sums (t = 0 on base rows)
        return kernels.row_masses(p, q, t, s)
    if unmodified:  # m = p
        e = torch.addcmul(p, q, as_row_scalars(s, p), value=-1)
    else:
        e = residual_weights(p, q, t).addcmul_(q, as_row_scalars(s, p), value=-1)
    return e.clamp_min(0).sum(-1).double(), e.clamp_max_(0).sum(-1).double().neg()


def _mass_acceptance(premain: torch.Tensor, prej: torch.Tensor) -> torch.Tensor:
    """min(1, premain / prej), 1 where prej = 0."""
    return torch.where(prej > 0, (premain / prej.clamp_min(1e-300)).clamp_max(1), 1.0)


def _bound_factor(dtype: torch.dtype) -> float:
    """acc_i <= min(1, Σm / (s Σq)) = (z / s) · this, for rows of dtype: rows sum to 1 within
    ROW_SUM_TOL, and the slack also covers the sums' rounding."""
    return (1 + ROW_SUM_TOL) / (1 - ROW_SUM_TOL) + 8 * torch.finfo(dtype).eps


def _greedy_tau(
    backend: Backend,
    p: torch.Tensor,  # [B, γ+1, V]: base target rows of prefix lengths 0..γ along one path
    q: torch.Tensor,  # [B, γ, V]
    rows: ResidualRows,  # [B, γ]: the law verified against, where not forced
    log_joint: torch.Tensor,  # [B, γ+1]: log P(prefix) under that law
    log_joint_q: torch.Tensor,  # [B, γ+1]
    q_forced: torch.Tensor | None,  # [B, γ] float64: q of A's token at each length
    forced: torch.Tensor | None,  # [B, γ] bool: rows that are one-hot on A; None: no row is
    u: torch.Tensor,  # [B, γ] float64: η_1..η_γ
) -> torch.Tensor:
    """τ [B]: the last level i = 1..γ whose test η_i < acc_i passes, 0 if none (Alg. 4).

    i < γ: acc_i = min(1, premain_i / prej_i) with premain = Σ(P(X^i x) - Q(X^i x))_+ and
    prej = Σ(Q - P)_+ (prej = 0 gives 1); i = γ: min(1, P(X^γ) / Q(X^γ)). Both sums are
    scale-free; divided by P(X^i)/z, with s = z Q(X^i)/P(X^i) and m = (p - t q)_+:
    premain ∝ Σ(m - s q)_+ and prej ∝ Σ(s q - m)_+, one tensor e = m - s q for both.
    A one-hot row on a (forced prefix), divided by Q(X^i) with ρ = P/Q: premain ∝ (ρ - q(a))_+,
    prej ∝ (1 - q(a)) + (q(a) - ρ)_+ (q rows sum to 1).

    On the device backends every level's masses are one batched pass (_tau_of_every_level);
    on the host ones only the levels that can decide τ are summed (_tau_top_down). The same
    tokens either way."""
    gamma = q.shape[1]
    log_p, log_q = log_joint[:, 1:gamma], log_joint_q[:, 1:gamma]
    t, z = rows.t[:, 1:], rows.z[:, 1:]
    s = (z * (log_q - log_p).exp()).clamp_max(T_MAX)  # P(X^i) = 0: s = T_MAX, acceptance 0
    last = (log_joint[:, gamma] - log_joint_q[:, gamma]).clamp_max(0).exp()
    known = torch.where(log_p > -torch.inf, torch.nan, 0.0)  # NaN: the masses decide
    if forced is not None:
        rho = (log_p - log_q).exp()
        qa = q_forced[:, 1:]
        acc_forced = ((rho - qa).clamp_min(0) / ((1 - qa) + (qa - rho).clamp_min(0))).clamp_max(1)
        known = torch.where(forced[:, 1:], acc_forced.nan_to_num(1.0), known)
    levels = _Levels(p[:, 1:gamma], q[:, 1:], t, s, rows.unmodified, known, last, u)
    if backend.reads_host:
        return _tau_top_down(backend, levels, z)
    return _tau_of_every_level(backend, levels)


@dataclass(frozen=True)
class _Levels:
    """What _greedy_tau's levels i = 1..γ-1 are tested with (level γ needs no masses)."""

    p: torch.Tensor  # [B, γ-1, V]: base target rows of the levels
    q: torch.Tensor  # [B, γ-1, V]
    t: torch.Tensor  # [B, γ-1] float64: the rows' offsets
    s: torch.Tensor  # [B, γ-1] float64: z Q(X^i) / P(X^i)
    unmodified: bool  # every t = 0 (ResidualRows.unmodified)
    known: torch.Tensor  # [B, γ-1] float64: acc_i where known without masses, else NaN
    last: torch.Tensor  # [B]: acc_γ
    u: torch.Tensor  # [B, γ] float64: η_1..η_γ


def _tau_of_every_level(backend: Backend, levels: _Levels) -> torch.Tensor:
    """τ [B] from every level's masses, one batched pass: no host reads."""
    lv = levels
    masses = over_batch_chunks(_level_masses, backend, lv.p, lv.q, lv.t, lv.s, lv.unmodified)
    acc = torch.where(lv.known.isnan(), _mass_acceptance(*masses), lv.known)
    return last_passing_level(lv.u, torch.cat([acc, lv.last.unsqueeze(1)], dim=1))


def _tau_top_down(
    backend: Backend,
    levels: _Levels,
    z: torch.Tensor,  # [B, γ-1] float64: the rows' normalisers
) -> torch.Tensor:
    """τ [B] with only the levels that can decide it summed: premain - prej = Σm - s Σq and
    prej <= s Σq, so acc_i <= min(1, Σm / (s Σq)) with Σm = z (Σp for a base row); a level
    with η_i above that bound fails unsummed, and the levels are tried top-down, stopping at
    the first pass. Reads the host once a round."""
    lv, u = levels, levels.u
    gamma = u.shape[1]
    bound = z / lv.s * _bound_factor(lv.p.dtype)
    passes = torch.cat([u[:, :-1] < lv.known, (u[:, -1] < lv.last).unsqueeze(1)], dim=1)
    unknown = lv.known.isnan() & ~(u[:, :-1] >= bound)  # a NaN bound (0/0) decides nothing
    unknown = torch.cat([unknown, torch.zeros_like(unknown[:, :1])], dim=1)  # [B, γ]
    ranks = torch.arange(1, gamma + 1, device=u.device)
    while True:
        top = torch.where(unknown | passes, ranks, 0).amax(-1)  # [B]: the level to look at
        need = unknown.gather(1, (top - 1).clamp_min(0).unsqueeze(1)).squeeze(1) & (top > 0)
        need = need.nonzero().squeeze(-1)  # [m]: requests whose top level needs its masses
        if not need.numel():
            break
        i = top[need] - 1  # [m]: level i + 1
        at = (need, i)
        masses = _level_masses(backend, lv.p[at], lv.q[at], lv.t[at], lv.s[at], lv.unmodified)
        passes[need, i] = u[need, i] < _mass_acceptance(*masses)
        unknown[need, i] = False
    return torch.where(passes, ranks, 0).amax(-1)


def greedy_verify_loops(
    backend: Backend,  # numba
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V] float32
    target_probs: torch.Tensor,  # [B, K, γ+1, V] float32: base target rows
    uniforms: torch.Tensor,  # [B, K*γ + 1]
    modified: ResidualRows,  # [B, K, γ]: earlier modifications carried into these rows
):
    """sequential_greedy_verify as one loop a request (loops.greedy_verify)."""
    B, K, gamma = draft_tokens.shape
    tau, path, y, rec_log_p, rec_log_q = loops.greedy_verify(
        draft_tokens,
        draft_probs,
        target_probs,
        uniforms,
        modified.t,
        modified.z,
        _bound_factor(target_probs.dtype),
        T_MAX,
    )
    rows_left = (gamma - 1 - tau).clamp_min(0)
    records = (rec_log_p, rec_log_q[:, None].expand(B, K), rows_left[:, None].expand(B, K).clone())
    return emit(take_rows(draft_tokens, path), tau, y), tau, path, records


def sequential_greedy_verify(
    backend: Backend,
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]: base target rows
    uniforms: torch.Tensor,  # [B, K*γ + 1]
    modified: ResidualRows,  # [B, K, γ]: earlier modifications carried into these rows
):
    """Returns (tokens, τ, path, new records (log_p [B, K], log_q [B, K], rows_left [B, K]))."""
    gamma = draft_tokens.shape[2]
    tok = draft_tokens.unsqueeze(-1)
    p_tok = target_probs[:, :, :gamma].gather(-1, tok).squeeze(-1).double()  # [B, K, γ]
    q_tok = draft_probs.gather(-1, tok).squeeze(-1).double()
    log_q = exclusive_cumsum(q_tok.log())  # [B, K, γ+1]
    rows = (draft_tokens, draft_probs, target_probs)
    length, best_path, joints = _accept_along_levels(
        backend, *rows, uniforms, modified, p_tok, q_tok, log_q
    )
    return _draw_and_records(backend, *rows, uniforms, modified, log_q, joints, length, best_path)


def _accept_along_levels(
    backend: Backend,
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]: base target rows
    uniforms: torch.Tensor,  # [B, K*γ + 1]
    modified: ResidualRows,  # [B, K, γ]: P_1, the carried law
    p_tok: torch.Tensor,  # [B, K, γ] float64: p of each path token (base rows)
    q_tok: torch.Tensor,  # [B, K, γ] float64
    log_q: torch.Tensor,  # [B, K, γ+1] float64: log Q of every prefix
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The K levels: τ_k of draft k against P_k, A_k, then P_{k+1} (the module's docstring).
    -> (|A| [B], the draft that set A [B], joints: joints[k] = log P_k(prefix) on paths
    k..K-1, [B, K-k, γ+1])."""
    B, K, gamma = draft_tokens.shape
    dev = draft_tokens.device
    accepted = torch.zeros(B, gamma, dtype=torch.int64, device=dev)  # A
    length = torch.zeros(B, dtype=torch.int64, device=dev)  # |A|
    best_path = torch.zeros(B, dtype=torch.int64, device=dev)  # the draft that set A
    positions = torch.arange(gamma, device=dev)
    # Level k's law P_k is only needed on paths k..K-1: path k is tested against it, later
    # paths build later levels from it. `rows` holds P_k there (where not forced onto A).
    rows = modified
    joints = []
    for k in range(K):
        if k:
            done = length == gamma  # a full block was accepted: later drafts are not tested
            forced = positions[None, :] < length[:, None]  # [B, γ]: P_k is one-hot on A there
            q_forced = draft_probs[:, k].gather(-1, accepted.unsqueeze(-1)).squeeze(-1).double()
        else:  # level 0 starts from an empty A: no row is forced and no block is done yet
            done = forced = q_forced = None
        log_p = _path_logp(p_tok[:, k:], q_tok[:, k:], rows, draft_tokens[:, k:], accepted, forced)
        joints.append(log_p)
        path_rows = ResidualRows(rows.t[:, 0], rows.z[:, 0], rows.unmodified)
        u = uniforms[:, k * gamma : (k + 1) * gamma]
        path_k = (target_probs[:, k], draft_probs[:, k], path_rows, log_p[:, 0], log_q[:, k])
        tau_k = _greedy_tau(backend, *path_k, q_forced, forced, u)
        longer = tau_k > length if done is None else (tau_k > length) & ~done
        accepted = torch.where(longer[:, None], draft_tokens[:, k], accepted)
        length = torch.where(longer, tau_k, length)
        best_path = torch.where(longer, k, best_path)
        if k < K - 1:
            # P_{k+1} = ForcedPrefix(A_k) ∘ M_new(P_k): M_new on every row (rows at lengths
            # < |A_k| are forced whatever their offsets); the bonus row is never modified.
            t, z = m_new(
                backend,
                target_probs[:, k + 1 :, :gamma],
                draft_probs[:, k + 1 :],
                rows.t[:, 1:],
                rows.z[:, 1:],
                log_p[:, 1:, :gamma],
                log_q[:, k + 1 :, :gamma],
            )
            rows = ResidualRows(t, z)
    return length, best_path, joints


def _draw_and_records(
    backend: Backend,
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]: base target rows
    uniforms: torch.Tensor,  # [B, K*γ + 1]
    modified: ResidualRows,  # [B, K, γ]: P_1
    log_q: torch.Tensor,  # [B, K, γ+1] float64: log Q of every prefix
    joints: list[torch.Tensor],  # _accept_along_levels'
    length: torch.Tensor,  # [B] int64: |A|
    best_path: torch.Tensor,  # [B] int64: the draft that set A
):
    """y ~ P_{K+1}(·|A) and record k = the joint of (A, y) under P_k and under the draft,
    window lengths |A|+1..γ-1. -> (tokens, τ, path, records)."""
    B, K, gamma = draft_tokens.shape
    ar = torch.arange(B, device=draft_tokens.device)
    at = length.clamp_max(gamma - 1)
    p_row = rows_at(target_probs, ar, best_path, length)  # [B, V]
    q_row = rows_at(draft_probs, ar, best_path, at)
    log_q_a = log_q[ar, best_path, length]
    level_t, level_z, level_joints, t, z = _laws_along_a(
        backend, modified, joints, p_row, q_row, log_q_a, length, best_path
    )
    weights = residual_weights(p_row, q_row, t)
    y = sample_from_weights(weights / z.to(weights.dtype).unsqueeze(-1), uniforms[:, K * gamma])
    y_col = y.unsqueeze(-1)
    p_y = p_row.gather(-1, y_col).squeeze(-1).double()
    q_y = q_row.gather(-1, y_col).squeeze(-1).double()
    rec_log_p = torch.stack(
        [
            j + residual_prob(p_y, q_y, lt, lz).log()
            for lt, lz, j in zip(level_t, level_z, level_joints, strict=True)
        ],
        dim=1,
    )
    rec_log_q = log_q_a + q_y.log()
    rows_left = (gamma - 1 - length).clamp_min(0)
    records = (
        rec_log_p,
        rec_log_q.unsqueeze(1).expand(B, K),
        rows_left.unsqueeze(1).expand(B, K).clone(),
    )
    return emit(draft_tokens[ar, best_path], length, y), length, best_path, records


def _laws_along_a(
    backend: Backend,
    modified: ResidualRows,  # [B, K, γ]: P_1
    joints: list[torch.Tensor],  # _accept_along_levels'
    p_row: torch.Tensor,  # [B, V]: the base target row after A
    q_row: torch.Tensor,  # [B, V]: its draft row
    log_q_a: torch.Tensor,  # [B] float64: log Q(A)
    length: torch.Tensor,  # [B] int64: |A|
    best_path: torch.Tensor,  # [B] int64: the draft that set A
):
    """Each level's row after A and P_k(A), k = 1..K, then P_{K+1}'s row. Along A,
    P_{k+1}(·|A) = M_new(P_k)(·|A) (|A| >= |A_k|, never forced), so one row per level
    suffices. P_k(A) is on record for k <= best_path (path best_path was among the paths of
    level k); for later levels A is forced, P_k(A) = 1.
    -> (t of levels [B] each, z of levels, P_k(A) of levels, t and z of P_{K+1} [B])."""
    gamma = modified.t.shape[2]
    ar = torch.arange(length.shape[0], device=length.device)
    at = length.clamp_max(gamma - 1)
    modifiable = length < gamma  # the bonus row (|A| = γ) is never modified
    if modified.unmodified:
        t, z = torch.zeros_like(log_q_a), torch.ones_like(log_q_a)
    else:
        t = torch.where(modifiable, modified.t[ar, best_path, at], 0.0)
        z = torch.where(modifiable, modified.z[ar, best_path, at], 1.0)
    level_t, level_z, level_joints = [], [], []
    for k, level_joint in enumerate(joints):
        if k:
            joint = level_joint[ar, (best_path - k).clamp_min(0), length]
            joint = torch.where(best_path >= k, joint, 0.0)
        else:
            joint = level_joint[ar, best_path, length]
        level_t.append(t)
        level_z.append(z)
        level_joints.append(joint)
        t_new, z_new = m_new(backend, p_row, q_row, t, z, joint, log_q_a)
        t, z = torch.where(modifiable, t_new, t), torch.where(modifiable, z_new, z)
    return level_t, level_z, level_joints, t, z
