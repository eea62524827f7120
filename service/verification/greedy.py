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
"""

from __future__ import annotations

import torch

from workers.sampling import sample_from_weights

from .common import (
    emit,
    exclusive_cumsum,
    last_passing_level,
    scaled_difference,
)
from .modification import m_new


def num_uniforms(k: int, gamma: int) -> int:
    return k * gamma + 1  # one η per level per draft, one for the recovered/bonus sample


def _path_logp(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """rows [B, P, >=γ, V], tokens [B, P, γ] -> log joint of every prefix [B, P, γ+1] float64."""
    gamma = tokens.shape[-1]
    tok = rows[:, :, :gamma].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return exclusive_cumsum(tok.double().log())


def _next_level(
    rows: torch.Tensor,  # [B, P, >=γ, V]: P_k along each path (rows of prefix lengths < γ)
    log_joint: torch.Tensor,  # [B, P, γ+1]: log P_k(prefix)
    log_joint_q: torch.Tensor,  # [B, P, γ+1]: log Q(prefix)
    q: torch.Tensor,  # [B, P, γ, V]
    accepted: torch.Tensor,  # [B, γ] int64: A_k (first `length` entries meaningful)
    length: torch.Tensor,  # [B] int64: |A_k|
) -> torch.Tensor:
    """P_{k+1} = ForcedPrefix(A_k) ∘ M_new(P_k) along each path.

    Rows at prefix lengths < |A_k| are one-hot on A_k (prefixes that left A_k already have
    joint 0, so their row is irrelevant); rows at lengths |A_k|..γ-1 (all >= τ_k) are M_new;
    the bonus row (length γ) is never modified, so it is not returned:
    levels hold rows of prefix lengths 0..γ-1 only ([B, P, γ, V]).
    """
    gamma = q.shape[2]
    head = m_new(log_joint[..., :gamma], rows[:, :, :gamma], log_joint_q[..., :gamma], q)
    forced = torch.zeros_like(head[:, 0]).scatter_(-1, accepted.unsqueeze(-1), 1.0)  # [B, γ, V]
    is_forced = torch.arange(gamma, device=q.device)[None, :] < length[:, None]  # [B, γ]
    return torch.where(is_forced[:, None, :, None], forced[:, None], head)


def _greedy_levels(
    rows: torch.Tensor,  # [B, >=γ, V]: the law verified against, along one path
    log_joint: torch.Tensor,  # [B, γ+1]
    log_joint_q: torch.Tensor,  # [B, γ+1]
    q: torch.Tensor,  # [B, γ, V]
) -> torch.Tensor:
    """Acceptance probability of every level i = 1..γ of one path (Alg. 4): [B, γ].

    i < γ: min(1, premain_i / prej_i) with premain = Σ(P(X^i x) - Q(X^i x))_+ and
    prej = Σ(Q - P)_+ (prej = 0 gives 1); i = γ: min(1, P(X^γ) / Q(X^γ)).
    """
    gamma = q.shape[1]
    diff = scaled_difference(
        log_joint[:, 1:gamma], rows[:, 1:gamma], log_joint_q[:, 1:gamma], q[:, 1:]
    )
    premain = diff.clamp_min(0).sum(-1)
    prej = (-diff).clamp_min(0).sum(-1)
    acc = torch.where(prej > 0, (premain / prej.clamp_min(1e-300)).clamp_max(1), 1.0)
    last = (log_joint[:, gamma] - log_joint_q[:, gamma]).clamp_max(0).exp()
    return torch.cat([acc.double(), last.unsqueeze(1)], dim=1)


def sequential_greedy_verify(
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]: already carrying earlier modifications
    uniforms: torch.Tensor,  # [B, K*γ + 1]
):
    """Returns (tokens, τ, path, new records (log_p [B, K], log_q [B, K], rows_left [B, K]))."""
    B, K, gamma = draft_tokens.shape
    dev = draft_tokens.device
    ar = torch.arange(B, device=dev)
    log_q = exclusive_cumsum(
        draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1).double().log()
    )

    accepted = torch.zeros(B, gamma, dtype=torch.int64, device=dev)  # A
    length = torch.zeros(B, dtype=torch.int64, device=dev)  # |A|
    best_path = torch.zeros(B, dtype=torch.int64, device=dev)  # the draft that set A
    # Level k's law P_k is only needed on paths k..K-1: path k is tested against it, later
    # paths build later levels from it. `rows` holds P_k on those paths.
    rows = target_probs
    joints = []  # joints[k]: log P_k(prefix) on paths k..K-1, [B, K-k, γ+1]
    for k in range(K):
        done = length == gamma  # a full block was accepted: later drafts are not tested
        log_p = _path_logp(rows, draft_tokens[:, k:])
        joints.append(log_p)
        acc = _greedy_levels(rows[:, 0], log_p[:, 0], log_q[:, k], draft_probs[:, k])
        tau_k = last_passing_level(uniforms[:, k * gamma : (k + 1) * gamma], acc)
        longer = (tau_k > length) & ~done
        accepted = torch.where(longer[:, None], draft_tokens[:, k], accepted)
        length = torch.where(longer, tau_k, length)
        best_path = torch.where(longer, k, best_path)
        if k < K - 1:
            rows = _next_level(
                rows[:, 1:],
                log_p[:, 1:],
                log_q[:, k + 1 :],
                draft_probs[:, k + 1 :],
                accepted,
                length,
            )

    # y ~ P_{K+1}(·|A). Along A, P_{k+1}(·|A) = M_new(P_k)(·|A) (|A| >= |A_k|, never forced),
    # so one row per level suffices. P_k(A) is on record for k <= best_path (path best_path
    # was among the paths of level k); for later levels A is forced, P_k(A) = 1.
    row = target_probs[ar, best_path, length]  # [B, V]
    q_row = draft_probs[ar, best_path, length.clamp_max(gamma - 1)]
    log_q_a = log_q[ar, best_path, length]
    modifiable = (length < gamma)[:, None]  # the bonus row (|A| = γ) is never modified
    level_rows, level_joints = [], []
    for k in range(K):
        joint = joints[k][ar, (best_path - k).clamp_min(0), length]
        joint = torch.where(best_path >= k, joint, 0.0)
        level_rows.append(row)
        level_joints.append(joint)
        row = torch.where(modifiable, m_new(joint, row, log_q_a, q_row), row)
    y = sample_from_weights(row, uniforms[:, K * gamma])

    # Record k: joint of (A, y) under P_k and under the draft; window = lengths |A|+1..γ-1.
    y_col = y.unsqueeze(-1)
    rec_log_p = torch.stack(
        [
            j + r.gather(-1, y_col).squeeze(-1).double().log()
            for r, j in zip(level_rows, level_joints, strict=True)
        ],
        dim=1,
    )
    rec_log_q = log_q_a + q_row.gather(-1, y_col).squeeze(-1).double().log()
    rows_left = (gamma - 1 - length).clamp_min(0)
    records = (
        rec_log_p,
        rec_log_q.unsqueeze(1).expand(B, K),
        rows_left.unsqueeze(1).expand(B, K).clone(),
    )
    return emit(draft_tokens[ar, best_path], length, y), length, best_path, records
