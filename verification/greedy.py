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

On CPU with float32 rows the whole call is one numba loop a request
(cpu_verifiers.greedy_verify): the same levels, with M_new only on rows that are not forced
onto A (a forced row's offsets are never read again) and τ_k tested only above |A| (a level at
or below |A| cannot lengthen A). The torch ops below are the other dtypes' and devices' path.
"""

from __future__ import annotations

import torch

from . import cpu_kernels, cpu_verifiers, kernels
from .common import (
    ROW_SUM_TOL,
    emit,
    exclusive_cumsum,
    host_reads_are_free,
    last_passing_level,
    over_batch_chunks,
    take_rows,
)
from .modification import (
    T_MAX,
    ResidualRows,
    as_row_scalars,
    m_new,
    residual_prob,
    residual_weights,
)
from .tensors import rows_at, sample_from_weights


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
    p: torch.Tensor,  # [..., V]: base target rows
    q: torch.Tensor,  # [..., V]
    t: torch.Tensor,  # [...] float64: the rows' offsets (ResidualRows.t)
    s: torch.Tensor,  # [...] float64: z Q(X^i) / P(X^i)
    unmodified: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """premain ∝ Σ(m - s q)_+ and prej ∝ Σ(s q - m)_+ with m = (p - t q)_+, float64 [...]."""
    if kernels.applies(p, q):  # CUDA: one fused pass for both sums (t = 0 on base rows)
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

    Off the CPU every level's masses are one batched pass. On CPU only the levels that can
    decide τ are summed: premain - prej = Σm - s Σq and prej <= s Σq, so
    acc_i <= min(1, Σm / (s Σq)) with Σm = z (Σp for a base row); a level with η_i above that
    bound fails unsummed, and the levels are tried top-down, stopping at the first pass. The
    same tokens either way."""
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

    def masses(p, q, t, s):
        return _level_masses(p, q, t, s, rows.unmodified)

    if not host_reads_are_free(p):
        acc = _mass_acceptance(*over_batch_chunks(masses, p[:, 1:gamma], q[:, 1:], t, s))
        acc = torch.where(known.isnan(), acc, known)
        return last_passing_level(u, torch.cat([acc, last.unsqueeze(1)], dim=1))
    bound = z / s * _bound_factor(p.dtype)
    passes = torch.cat([u[:, :-1] < known, (u[:, -1] < last).unsqueeze(1)], dim=1)  # [B, γ]
    unknown = known.isnan() & ~(u[:, :-1] >= bound)  # a NaN bound (0/0: no mass) decides nothing
    unknown = torch.cat([unknown, torch.zeros_like(unknown[:, :1])], dim=1)
    levels = torch.arange(1, gamma + 1, device=u.device)
    while True:
        top = torch.where(unknown | passes, levels, 0).amax(-1)  # [B]: the level to look at
        need = unknown.gather(1, (top - 1).clamp_min(0).unsqueeze(1)).squeeze(1) & (top > 0)
        need = need.nonzero().squeeze(-1)  # [m]: requests whose top level needs its masses
        if not need.numel():
            break
        i = top[need] - 1  # [m]: mass level i + 1, row i + 1 of p and q
        acc = _mass_acceptance(*masses(p[need, i + 1], q[need, i + 1], t[need, i], s[need, i]))
        passes[need, i] = u[need, i] < acc
        unknown[need, i] = False
    return torch.where(passes, levels, 0).amax(-1)


def sequential_greedy_verify(
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]: base target rows
    uniforms: torch.Tensor,  # [B, K*γ + 1]
    modified: ResidualRows,  # [B, K, γ]: earlier modifications carried into these rows
):
    """Returns (tokens, τ, path, new records (log_p [B, K], log_q [B, K], rows_left [B, K]))."""
    B, K, gamma = draft_tokens.shape
    if host_reads_are_free(draft_probs) and cpu_kernels.applies(draft_probs, target_probs):
        # float32 CPU rows: all of the below as one loop a request (cpu_verifiers.greedy_verify)
        tau, path, y, rec_log_p, rec_log_q = cpu_verifiers.greedy_verify(
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
        records = (
            rec_log_p,
            rec_log_q[:, None].expand(B, K),
            rows_left[:, None].expand(B, K).clone(),
        )
        return emit(take_rows(draft_tokens, path), tau, y), tau, path, records
    dev = draft_tokens.device
    ar = torch.arange(B, device=dev)
    tok = draft_tokens.unsqueeze(-1)
    p_tok = target_probs[:, :, :gamma].gather(-1, tok).squeeze(-1).double()  # [B, K, γ]
    q_tok = draft_probs.gather(-1, tok).squeeze(-1).double()
    log_q = exclusive_cumsum(q_tok.log())  # [B, K, γ+1]

    accepted = torch.zeros(B, gamma, dtype=torch.int64, device=dev)  # A
    length = torch.zeros(B, dtype=torch.int64, device=dev)  # |A|
    best_path = torch.zeros(B, dtype=torch.int64, device=dev)  # the draft that set A
    positions = torch.arange(gamma, device=dev)
    # Level k's law P_k is only needed on paths k..K-1: path k is tested against it, later
    # paths build later levels from it. `rows` holds P_k there (where not forced onto A).
    rows = modified
    joints = []  # joints[k]: log P_k(prefix) on paths k..K-1, [B, K-k, γ+1]
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
        tau_k = _greedy_tau(
            target_probs[:, k],
            draft_probs[:, k],
            path_rows,
            log_p[:, 0],
            log_q[:, k],
            q_forced,
            forced,
            uniforms[:, k * gamma : (k + 1) * gamma],
        )
        longer = tau_k > length if done is None else (tau_k > length) & ~done
        accepted = torch.where(longer[:, None], draft_tokens[:, k], accepted)
        length = torch.where(longer, tau_k, length)
        best_path = torch.where(longer, k, best_path)
        if k < K - 1:
            # P_{k+1} = ForcedPrefix(A_k) ∘ M_new(P_k): M_new on every row (rows at lengths
            # < |A_k| are forced whatever their offsets); the bonus row is never modified.
            t, z = m_new(
                target_probs[:, k + 1 :, :gamma],
                draft_probs[:, k + 1 :],
                rows.t[:, 1:],
                rows.z[:, 1:],
                log_p[:, 1:, :gamma],
                log_q[:, k + 1 :, :gamma],
            )
            rows = ResidualRows(t, z)

    # y ~ P_{K+1}(·|A). Along A, P_{k+1}(·|A) = M_new(P_k)(·|A) (|A| >= |A_k|, never forced),
    # so one row per level suffices. P_k(A) is on record for k <= best_path (path best_path
    # was among the paths of level k); for later levels A is forced, P_k(A) = 1.
    at = length.clamp_max(gamma - 1)
    p_row = rows_at(target_probs, ar, best_path, length)  # [B, V]
    q_row = rows_at(draft_probs, ar, best_path, at)
    log_q_a = log_q[ar, best_path, length]
    modifiable = length < gamma  # the bonus row (|A| = γ) is never modified
    if modified.unmodified:
        t, z = torch.zeros_like(log_q_a), torch.ones_like(log_q_a)
    else:
        t = torch.where(modifiable, modified.t[ar, best_path, at], 0.0)
        z = torch.where(modifiable, modified.z[ar, best_path, at], 1.0)
    level_t, level_z, level_joints = [], [], []
    for k in range(K):
        if k:
            joint = joints[k][ar, (best_path - k).clamp_min(0), length]
            joint = torch.where(best_path >= k, joint, 0.0)
        else:
            joint = joints[0][ar, best_path, length]
        level_t.append(t)
        level_z.append(z)
        level_joints.append(joint)
        t_new, z_new = m_new(p_row, q_row, t, z, joint, log_q_a)
        t, z = torch.where(modifiable, t_new, t), torch.where(modifiable, z_new, z)
    weights = residual_weights(p_row, q_row, t)
    y = sample_from_weights(weights / z.to(weights.dtype).unsqueeze(-1), uniforms[:, K * gamma])

    # Record k: joint of (A, y) under P_k and under the draft; window = lengths |A|+1..γ-1.
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
