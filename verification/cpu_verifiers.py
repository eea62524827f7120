"""Whole verifiers as numba loops a request, for float32 rows on CPU: traversal
verification's walk, GBV's selection, levels and draw, greedy BV's and SpecTr-GBV*'s levels
and draw, and the application of their carried records. This module drives the loops
(cpu_kernels keeps every compiled function, so that numba's per-file cache stays sound).

Batched torch ops dispatch ~80 ops a segment (traversal), ~300 a call (GBV) or ~600
(SpecTr-GBV* at K = 4), and make several passes over every row they touch; at small batches
that is most of a call. These loops
take the same steps in the same order, one request at a time (requests split over
cpu_kernels' thread pool), and read each row they need once. They repeat the torch ops'
float32 arithmetic; their sums (a node's mass, C at a drafted token, the sampler's running
total) are float64 in their own order and exp/log come from libm, so a test or a draw whose
uniform lies within a few float32 ulps of its threshold could go the other way. Nothing else
differs: the tests compare their tokens with the torch ops' on every regime.
"""

from __future__ import annotations

import numpy as np
import torch

from .common import support_holding
from .cpu_kernels import (
    _apply_records,
    _block_verify,
    _gbv_draw,
    _gbv_level,
    _gbv_path,
    _greedy_verify,
    _kseq_draws,
    _level_words,
    _recovered_draws,
    _traversal_walk,
    over_row_ranges,
    sort_words,
)


def _arrays(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The loops' inputs as numpy arrays (contiguous; no copy where they already are)."""
    return [t.contiguous().numpy() for t in tensors]


def _over_requests(loop, n: int, *args) -> None:
    """loop(*args, lo, hi) on consecutive ranges of n requests, split over the kernels' pool
    (a loop allocates its own scratch: the ranges run at once)."""
    over_row_ranges(lambda lo, hi: loop(*args, lo, hi), n)


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
    inputs = _arrays(target_probs, draft_probs, draft_tokens, leaves, branch, log_ratio, uniforms)
    _over_requests(_traversal_walk, B, *inputs, tau, path, y)
    return torch.from_numpy(tau), torch.from_numpy(path), torch.from_numpy(y)


def gbv_verify(
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V] float32
    target_probs: torch.Tensor,  # [B, K, γ+1, V] float32
    uniforms: torch.Tensor,  # [B, γ+1]
    support: torch.Tensor | None,  # [V'] ids outside which q is 0 (draft_support), or None
    slack: float,  # levels_top_down's bound on h_i / p_i
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gbv.gbv_verify at K > 1 as numba loops a request: selection, the path's values and
    λ below the highest level it can reach, then rounds of levels tried top-down, each ranking
    the live tokens of one row per undecided request (numpy's sort of their sort words
    between two loops), then the residual draw. -> τ [B], path [B], y [B] int64."""
    B, K, gamma, V = draft_probs.shape
    tokens, p, q = _arrays(draft_tokens, target_probs, draft_probs)
    eta = uniforms[:, :gamma].float().numpy()  # compared in the rows' dtype, as the torch ops
    u = uniforms[:, gamma].double().numpy()
    path, tau, level = (np.empty(B, np.int64) for _ in range(3))
    lam, pi = np.empty((B, gamma)), np.empty((B, gamma), np.float32)
    _over_requests(_gbv_path, B, p, q, tokens, K, eta, slack, path, lam, pi, tau, level)
    support = support_holding(support, torch.from_numpy(tokens[np.arange(B), path]))
    ids = np.arange(V) if support is None else support.numpy()
    # q̃ at the level tried last (+inf at its dead tokens); 0 where τ = γ: the bonus token
    q_row = np.zeros((B, V), np.float32)
    rows = np.flatnonzero(tau < 0)
    while rows.size:
        n = rows.size
        words, counts = np.empty((n, ids.size), np.int64), np.empty(n, np.int64)
        ranking = (words, counts, np.empty(n))  # the live words, their count, the dead mass
        args = (p, q, path, level, rows, ids, lam, pi, K, eta, slack, *ranking, q_row)
        _over_requests(_level_words, n, *args)
        sort_words(words, counts)
        state = (lam, pi, K, eta, slack, tau, q_row)
        _over_requests(_gbv_level, n, p, q, path, level, rows, *ranking, *state)
        rows = rows[tau[rows] < 0]
    y = np.empty(B, np.int64)
    _over_requests(_gbv_draw, B, p, path, tau, pi, q_row, u, y)
    return torch.from_numpy(tau), torch.from_numpy(path), torch.from_numpy(y)


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
    inputs = _arrays(
        target_probs, draft_probs, draft_tokens, uniforms.double(), t.double(), z.double()
    )
    tau, path, y = (np.empty(B, np.int64) for _ in range(3))
    rec_p, rec_q = np.empty((B, K)), np.empty(B)
    _over_requests(_greedy_verify, B, *inputs, bound_factor, t_max, tau, path, y, rec_p, rec_q)
    return tuple(torch.from_numpy(a) for a in (tau, path, y, rec_p, rec_q))


def apply_records(
    tokens: torch.Tensor,  # [B, P, L] int64
    draft_probs: torch.Tensor,  # [B, P, L, V] float32
    target_probs: torch.Tensor,  # [B, P, L+1, V] float32
    log_p: torch.Tensor,  # [B, R] float64: TargetModification's fields
    log_q: torch.Tensor,  # [B, R] float64
    rows_left: torch.Tensor,  # [B, R] int64
    t_max: float,  # modification.T_MAX
) -> tuple[torch.Tensor, ...]:
    """modification.apply_records as one loop a request, each record passing over the rows in
    its own window only. -> the modified rows' t, z [B, P, L] and each record's base rows'
    t, z [B, R, P, L] (float64)."""
    B, P, L = tokens.shape
    R = rows_left.shape[1]
    inputs = _arrays(target_probs, draft_probs, tokens, log_p.double(), log_q.double(), rows_left)
    t, z = np.empty((B, P, L)), np.empty((B, P, L))
    base_t, base_z = np.empty((B, R, P, L)), np.empty((B, R, P, L))
    _over_requests(_apply_records, B, *inputs, t_max, t, z, base_t, base_z)
    return tuple(torch.from_numpy(a) for a in (t, z, base_t, base_z))


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
    tokens, q_np, p_np = _arrays(x, q, p)
    eta = uniforms[:, :gamma].float().numpy()  # compared in the rows' dtype, as the torch ops
    u = uniforms[:, gamma].double().numpy()
    pi = np.empty((B, gamma), np.float32)
    tau, y = np.empty(B, np.int64), np.empty(B, np.int64)
    _over_requests(_block_verify, B, p_np, q_np, tokens, eta, u, slack, pi, tau, y)
    return torch.from_numpy(tau), torch.from_numpy(y)


def recovered_tokens(
    target_probs: torch.Tensor,  # [B, K, γ+1, V] float32
    draft_probs: torch.Tensor,  # [B, K, γ, V] float32
    b: torch.Tensor,  # [m] int64: requests
    k: torch.Tensor,  # [m] int64: their paths
    tau: torch.Tensor,  # [m] int64: the depths they stopped at (γ: the bonus token)
    u: torch.Tensor,  # [m] float64
) -> torch.Tensor:
    """token.recovered_token at rows[b, k, τ] as one loop a row, read in place (no gathered
    copies). -> y [m] int64."""
    y = np.empty(b.shape[0], np.int64)
    inputs = _arrays(target_probs, draft_probs, b, k, tau, u.double())
    _over_requests(_recovered_draws, b.shape[0], *inputs, y)
    return torch.from_numpy(y)


def kseq_residual_tokens(
    p_row: torch.Tensor,  # [n, V] float32
    q_row: torch.Tensor,  # [n, V] float32
    rows: torch.Tensor,  # [m] int64: the rows to draw for
    rho: torch.Tensor,  # [n] float32
    scale: torch.Tensor,  # [n] float32: (1 - (1 - β)^n) / β
    u: torch.Tensor,  # [n] float64
) -> torch.Tensor:
    """top_down.spectr_rule's residual draw at the given rows only, one pass over each.
    -> y [m] int64."""
    y = np.empty(rows.shape[0], np.int64)
    inputs = _arrays(p_row, q_row, rows, rho.float(), scale.float(), u.double())
    _over_requests(_kseq_draws, rows.shape[0], *inputs, y)
    return torch.from_numpy(y)
