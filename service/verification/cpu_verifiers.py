"""Whole verifiers as numba loops a request, for float32 rows on CPU: traversal
verification's walk and GBV's selection, levels and draw.

Batched torch ops dispatch ~80 ops a segment (traversal) or ~300 a call (GBV), and make
several passes over every row they touch; at small batches that is most of a call. These loops
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
    _draw,
    _excess_mass,
    _f32,
    _jit,
    _mass_below,
    _ratio,
    _residual_mass,
    _row_words,
    _skew_factors,
    _skew_walk,
    _skewed,
    over_row_ranges,
    sort_words,
)


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
    args = [
        t.contiguous().numpy()
        for t in (target_probs, draft_probs, draft_tokens, leaves, branch, log_ratio, uniforms)
    ]

    def walk(lo, hi):
        _traversal_walk(*args, tau, path, y, lo, hi)

    over_row_ranges(walk, B)
    return torch.from_numpy(tau), torch.from_numpy(path), torch.from_numpy(y)


@_jit
def _gbv_select(p, q, tokens, r, keys, best):
    """gbv_verify's selection for request r: the path whose (key, id) tuple of its drafted
    tokens is lexicographically largest, the first such path of ties."""
    K, gamma = tokens.shape[1], tokens.shape[2]
    best[:] = True
    for d in range(gamma):
        top = _f32(-1)
        for j in range(K):
            t = tokens[r, j, d]
            keys[j] = _ratio(p[r, j, d, t], q[r, j, d, t])
            if best[j]:
                top = max(top, keys[j])
        top_id = -1
        for j in range(K):
            if best[j] and keys[j] == top:
                top_id = max(top_id, tokens[r, j, d])
        for j in range(K):
            best[j] = best[j] and keys[j] == top and tokens[r, j, d] == top_id
    for j in range(K):
        if best[j]:
            return j
    return 0


@_jit
def _gbv_path(p, q, tokens, k, eta, slack, path, lam, pi, tau, level, lo, hi):
    """gbv_verify up to its levels, for requests lo..hi: the selected path; C, q and p at its
    tokens (no sort); λ of each prefix, q̃(x_i) and the running products p_i; then τ = γ if
    level γ passes, else the highest level i < γ whose η_i < p_i·slack (one that can pass,
    levels_top_down), in level[r] (-1 where decided)."""
    K, gamma = tokens.shape[1], tokens.shape[2]
    keys = np.empty(K, np.float32)
    best = np.empty(K, np.bool_)
    q_x = np.empty(gamma, np.float32)
    p_x = np.empty(gamma, np.float32)
    below = np.empty(gamma, np.float32)
    for r in range(lo, hi):
        j = _gbv_select(p, q, tokens, r, keys, best)
        path[r] = j
        for d in range(gamma):
            t = tokens[r, j, d]
            below[d] = _f32(_mass_below(p[r, j, d], q[r, j, d], t))
            q_x[d], p_x[d] = q[r, j, d, t], p[r, j, d, t]
        # λ_0 = 0, λ_{l+1} = (λ_l + C_l(x)) / q_l(x): gbv.prefix_lambdas
        lam[r, 0] = 0.0
        for d in range(1, gamma):
            lam[r, d] = (lam[r, d - 1] + np.float64(below[d - 1])) / np.float64(q_x[d - 1])
        # p_i = min(1, p_{i-1} p(x_i)/q̃(x_i)): block.running_products in float32 (the running
        # sum of logs in float64, as torch's CPU cumsum)
        running, peak = 0.0, _f32(-np.inf)
        for d in range(gamma):
            inv, t, scale = _skew_factors(lam[r, d], k)
            q_tilde = _skewed(q_x[d], below[d], inv, t, scale, k)
            running += np.float64(np.log(p_x[d]) - np.log(q_tilde))
            s = _f32(running)
            if s >= peak or s != s:
                peak = s
            pi[r, d] = np.exp(s - (peak if (peak > 0 or peak != peak) else _f32(0)))
        tau[r] = gamma if eta[r, gamma - 1] < pi[r, gamma - 1] else -1
        level[r] = -1 if tau[r] == gamma else _next_level(eta, pi, slack, r, gamma)


@_jit
def _next_level(eta, pi, slack, r, below):
    """The highest level i < below that η can pass: η_i < p_i·slack (level 0 always)."""
    i = below - 1
    while i > 0 and not np.float64(eta[r, i - 1]) < np.float64(pi[r, i - 1]) * slack:
        i -= 1
    return i


@_jit
def _level_words(p, q, path, level, rows, ids, words_id, words_key, lo, hi):
    """The sort words of row (path, level) of each request rows[i], over the ids given (the
    draft's support, or every token)."""
    for i in range(lo, hi):
        r = rows[i]
        at = (r, path[r], level[r])
        _row_words(p[at], q[at], ids, words_id[i], words_key[i])


@_jit
def _gbv_level(p, q, path, level, rows, ranked, lam, pi, k, eta, slack, tau, q_row, lo, hi):
    """One round of levels_top_down for requests rows[i]: q̃ of the row at its level, walked
    up its order (ranked[i, 0::2]) into q_row[r]; R = Σ(p_i p - q̃)_+ and the test
    η_i < R / (R + 1 - p_i) (0/0 -> 1). A pass (or level 0) sets τ; a failure moves
    level[r] to the next level η can pass."""
    for i in range(lo, hi):
        r = rows[i]
        lvl = level[r]
        pr, out = p[r, path[r], lvl], q_row[r]
        _skew_walk(q[r, path[r], lvl], ranked[i], lam[r, lvl], k, out)
        pi_lvl = _f32(1) if lvl == 0 else pi[r, lvl - 1]
        m = _residual_mass(pr, out, pi_lvl)
        denom = m + _f32(1) - pi_lvl
        h = m / denom if denom > 0 else _f32(1)
        if lvl == 0 or eta[r, lvl - 1] < h:
            tau[r] = lvl
        else:
            level[r] = _next_level(eta, pi, slack, r, lvl)


@_jit
def _gbv_draw(p, path, tau, pi, q_row, u, y, weights, lo, hi):
    """block.residual_token for requests lo..hi: y ~ (p_τ p - q̃)_+ at τ (p where that is
    all 0; at τ = γ q_row is 0: the bonus token), p_0 = 1."""
    for r in range(lo, hi):
        pr = p[r, path[r], tau[r]]
        pi_tau = _f32(1) if tau[r] == 0 else pi[r, tau[r] - 1]
        positive = False
        for v in range(pr.shape[0]):
            w = pi_tau * pr[v] - q_row[r, v]
            weights[v] = max(w, _f32(0))
            positive |= w > 0
        y[r] = _draw(weights if positive else pr, u[r])


def gbv_verify(
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V] float32
    target_probs: torch.Tensor,  # [B, K, γ+1, V] float32
    uniforms: torch.Tensor,  # [B, γ+1]
    support: torch.Tensor | None,  # [V'] ids outside which q is 0 (draft_support), or None
    slack: float,  # levels_top_down's bound on h_i / p_i
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gbv.gbv_verify at K > 1 as numba loops a request: selection, the path's values and
    λ, then rounds of levels tried top-down, each ranking one row per undecided request
    (numpy's sort of the sort words between two loops), then the residual draw.
    -> τ [B], path [B], y [B] int64."""
    B, K, gamma, V = draft_probs.shape
    tokens = draft_tokens.contiguous().numpy()
    p, q = target_probs.contiguous().numpy(), draft_probs.contiguous().numpy()
    eta = uniforms[:, :gamma].float().numpy()  # compared in the rows' dtype, as the torch ops
    u = uniforms[:, gamma].double().numpy()
    path, tau, level = (np.empty(B, np.int64) for _ in range(3))
    lam, pi = np.empty((B, gamma)), np.empty((B, gamma), np.float32)

    def prepare(lo, hi):
        _gbv_path(p, q, tokens, K, eta, slack, path, lam, pi, tau, level, lo, hi)

    over_row_ranges(prepare, B)
    support = support_holding(support, torch.from_numpy(tokens[np.arange(B), path]))
    ids = np.arange(V) if support is None else support.numpy()
    q_row = np.zeros((B, V), np.float32)  # q̃ at the level tried last; zeros where τ = γ
    rows = np.flatnonzero(tau < 0)
    while rows.size:
        words = np.empty((rows.size, ids.size), np.int64)
        words_id, words_key = words.view(np.int32), words.view(np.float32)

        def rank(lo, hi, rows=rows, words_id=words_id, words_key=words_key):
            _level_words(p, q, path, level, rows, ids, words_id, words_key, lo, hi)

        over_row_ranges(rank, rows.size)
        sort_words(words)

        def test(lo, hi, rows=rows, ranked=words_id):
            _gbv_level(p, q, path, level, rows, ranked, lam, pi, K, eta, slack, tau, q_row, lo, hi)

        over_row_ranges(test, rows.size)
        rows = rows[tau[rows] < 0]
    y = np.empty(B, np.int64)

    def draw(lo, hi):
        _gbv_draw(p, path, tau, pi, q_row, u, y, np.empty(V, np.float32), lo, hi)

    over_row_ranges(draw, B)
    return torch.from_numpy(tau), torch.from_numpy(path), torch.from_numpy(y)
