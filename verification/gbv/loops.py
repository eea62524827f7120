"""GBV as numba loops a request, for the numba backend (float32 CPU rows): the selection,
the path's values and λ below the highest level it can reach, then rounds of levels tried
top-down, each ranking the live tokens of one row per undecided request (numpy's sort of
their sort words between two loops), then the residual draw: the same steps as
gbv._verify_lazily in the same float32 arithmetic, where torch's ops cost ~300 dispatches a
call and ~10 passes over each row they touch.

The loops also skip what bounds prove unread: C at the path above the highest level the
running products' upper bounds can reach, the rank of the tokens whose residual (p_i p - q̃)_+
is 0 whatever their rank (q̃ ≥ F(C) q), and the ranking of a level whose test an upper bound
of R fails. Their sums (C at a drafted token, R, the sampler's total) are float64 in their
own order and exp/log come from libm: a test or a draw whose uniform lies within a few
float32 ulps of its threshold could go the other way (../cpu_kernels.py).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ..common import support_holding
from ..cpu_kernels import (
    _INF,
    _JIT_OPTIONS,
    _f32,
    _fma,
    _jit,
    _level_prob,
    _next_level,
    _product_before,
    _ratio,
    _residual_draw,
    _residual_mass,
    _running_products,
    _sort_word,
    _top_level,
    as_arrays,
    over_requests,
    sort_words,
)


@_jit
def _power_sum(a, b, k):
    """gbv._power_sum in the same float32 steps."""
    if k == 1:
        return _f32(1)
    total = a + b
    b_pow = b
    for _ in range(k - 2):
        b_pow = b_pow * b
        total = total * a + b_pow
    return total


@_jit
def _skew_factors(lam, k):
    """gbv.skewed_probs' per-prefix float32 factors of λ: 1/(λ+1), λ/(λ+1) and the divisor
    Σ_j t^j (divided through by (λ+1): no overflow)."""
    inv = _f32(1 / (lam + 1))
    t = _f32(lam / (lam + 1))
    return inv, t, _power_sum(_f32(1), t, k)


@_jit
def _skewed(q, below, inv, t, scale, k):
    """gbv.skewed_probs of one token, in its float32 steps: q̃ from q and C."""
    b = _fma(below, inv, t)  # torch.addcmul(t, below, inv)
    a = _fma(q, inv, b)
    return _power_sum(a, b, k) * q / scale


# GBV ranks only the tokens of a row whose residual (p_i p - q̃)_+ can be positive; the others
# need no rank, only their q mass in C of the tokens above them. q̃ grows with C: with
# a = q/(λ+1) + b ≥ b = C/(λ+1) + t, Σ_{j<k} a^j b^(k-1-j) ≥ k b^(k-1), so q̃(v) ≥ F(C(v)) q(v)
# with F(C) = k (C/(λ+1) + t)^(k-1) / Σ_{j<k} t^j. Every token with p/q < κ_0 = F(0)/p_i has a
# residual of 0; those above it have C ≥ D_0, the q mass below κ_0, so every token with
# p/q < κ_1 = F(D_0)/p_i has a residual of 0 too, and so on: the tokens below κ_n are "dead",
# a prefix of the (p/q, id) order, and every other token ranks above all of them. F is taken
# with a relative slack of 1e-4, far over the float32 roundings of q̃'s steps and of the key
# (2^-24 each, ~3k+6 of them), and D less 1e-9 (float64 sums of at most 1 in another order).
# A dead token's q̃ must also stay above 1e-30 (q F(0)), where float32 rounding is relative.
# Past λ ≈ 1, t is near 1 and most tokens are dead (~40% of a row at the bench's level 1,
# 70-99% further up); at λ = 0 (level 0) F(0) = 0 and every token is ranked.
_FLOOR_SLACK = 1 - 1e-4


_MASS_SLACK = 1e-9


_NORMAL = 1e-30


# p_i's bounds over the float32 logs and exp of _running_products (their error is < 1e-4).
_PI_SLACK = 1.01


_DEAD_ROUNDS = 4  # κ_n seldom grows past the second: F(0) is near F(1) once t is near 1


@numba.njit(**_JIT_OPTIONS, fastmath={"reassoc"})
def _mass_under(p, q, ids, kappa, tiny):
    """The q mass (float64, reassociated) of the tokens v of ids whose key p/q < κ (0/0 and
    p/0 are not), and whether one of them has q < tiny. Where ids is every token the loop
    reads the rows directly (a gather costs a dependent load per element)."""
    total, small = 0.0, 0.0  # small: a count as a float sum, which vectorises (a min would not)
    if ids.shape[0] == p.shape[0]:
        for v in range(p.shape[0]):
            under = np.float64(_f32(p[v] / q[v])) < kappa
            total += np.float64(q[v]) if under else 0.0
            small += 1.0 if under and q[v] < tiny else 0.0
    else:
        for j in range(ids.shape[0]):
            v = ids[j]
            under = np.float64(_f32(p[v] / q[v])) < kappa
            total += np.float64(q[v]) if under else 0.0
            small += 1.0 if under and q[v] < tiny else 0.0
    return total, small > 0


@_jit
def _skew_floor(below, inv, t, scale, k):
    """F(C) with its slacks (the comment above), float64, for C ≥ below."""
    base = max(below - _MASS_SLACK, 0.0) * np.float64(inv) + np.float64(t)
    return k * base ** (k - 1) / np.float64(scale) * _FLOOR_SLACK


@_jit
def _dead_prefix(p, q, ids, lam, k, pi):
    """κ and the q mass D of the dead tokens (p/q < κ) of the rows p, q [V] over ids, at a
    level of running product pi and prefix λ (the comment above), and F(D): q̃ ≥ F(D) q at
    every live token."""
    inv, t, scale = _skew_factors(lam, k)
    f_zero = _skew_floor(0.0, inv, t, scale, k)
    kappa, dead = 0.0, 0.0
    for _ in range(_DEAD_ROUNDS):
        grown = _skew_floor(dead, inv, t, scale, k) / np.float64(pi) if pi > 0 else np.inf
        if not grown > kappa * (1 + 1e-3) or not f_zero > 0:
            break
        mass, has_tiny = _mass_under(p, q, ids, grown, _NORMAL / f_zero)
        if has_tiny:
            break
        kappa, dead = grown, mass
    return kappa, dead, _skew_floor(dead, inv, t, scale, k)


@numba.njit(**_JIT_OPTIONS, fastmath={"reassoc"})
def _excess_above(p, q, kappa, pi, f):
    """Σ (π p - f q)_+ over the tokens of the rows p, q [V] whose key p/q is not below κ,
    float64 (reassociated). Every token: those outside a draft support have q = 0 and count
    whole (π p)."""
    total = 0.0
    for v in range(p.shape[0]):
        live = not np.float64(_f32(p[v] / q[v])) < kappa
        total += max(pi * np.float64(p[v]) - f * np.float64(q[v]), 0.0) if live else 0.0
    return total


@_jit
def _fails_unranked(p, q, kappa, f, pi, eta):
    """Whether a level's test η < h = R / (R + 1 - p_i) fails, shown without ranking its row:
    R ≤ Σ_live (p_i p - F(D) q)_+ (q̃ ≥ F(D) q at the live tokens, 0 at the dead ones) and h
    grows with R. Slacks: the float32 sum of R (1e-6, and 1e-36 for subnormal terms) and h's
    float32 steps, within 2e-4 where 1 - p_i ≥ 1e-3 (closer to 1, m + 1 - p_i cancels: no
    claim is made)."""
    if not pi <= _f32(0.999):
        return False
    r_up = _excess_above(p, q, kappa, np.float64(pi), f) * (1 + 1e-6) + 1e-36
    h_up = r_up / (r_up + 1 - np.float64(pi)) * (1 + 1e-3)
    return np.float64(eta) >= h_up


@_jit
def _live_words(p, q, ids, kappa, words, out):
    """The sort words (_sort_word) of the tokens of the rows p, q [V]
    over ids whose key is not below κ, packed at the front of words [V'] (-> their count);
    out[v] = +inf for every v of ids (the dead tokens' residual is 0; _live_walk overwrites
    the live ones)."""
    if kappa == 0:  # every token is live: no packing
        for j in range(ids.shape[0]):
            v = ids[j]
            words[j] = _sort_word(_ratio(p[v], q[v]), v)
        return ids.shape[0]
    n = 0
    for j in range(ids.shape[0]):  # branch-free: live and dead tokens interleave
        v = ids[j]
        key = _f32(_ratio(p[v], q[v]))
        words[n] = _sort_word(key, v)
        n += not np.float64(key) < kappa
        out[v] = _INF
    return n


@_jit
def _live_walk(q, words, dead, lam, k, out):
    """out[v] = q̃(v) of the live tokens of the row q [V], words [n] sorted: C(v) is the dead
    mass plus the running q mass of the live tokens below v (gbv.mass_ranked_below and
    gbv.skewed_probs; the sum float64 and sequential as torch's CPU cumsum but for the dead
    mass, summed apart)."""
    inv, t, scale = _skew_factors(lam, k)
    running = dead
    for j in range(words.shape[0]):
        v = words[j] & 0xFFFFFFFF
        qv = q[v]
        running += np.float64(qv)
        out[v] = _skewed(qv, _f32(running - np.float64(qv)), inv, t, scale, k)


@numba.njit(**_JIT_OPTIONS, fastmath={"reassoc"})
def _mass_below(p, q, x):
    """Σ_v q[v] over v ranked below x by (p/q, id) in the rows p, q [V]: float64. The sum may
    be reassociated, so that it vectorises (an in-order sum cannot)."""
    kx = _ratio(p[x], q[x])
    total = 0.0
    for v in range(p.shape[0]):
        k = _f32(p[v] / q[v])  # 0/0 is NaN here, not +inf: its q adds 0 anyway
        below = (k < kx) | ((k == kx) & (v < x))
        total += np.float64(q[v]) if below else 0.0
    return total


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
    levels_top_down), in level[r] (-1 where decided). C, λ, q̃ and p_i only below the highest
    level that upper bounds of p_i cannot rule out (_highest_reachable): the others are never
    read, and C at a token is a pass over its row."""
    K, gamma = tokens.shape[1], tokens.shape[2]
    keys = np.empty(K, np.float32)
    best = np.empty(K, np.bool_)
    q_x = np.empty(gamma, np.float32)
    p_x = np.empty(gamma, np.float32)
    q_tilde = np.empty(gamma, np.float32)
    below = np.empty(gamma, np.float32)
    for r in range(lo, hi):
        j = _gbv_select(p, q, tokens, r, keys, best)
        path[r] = j
        for d in range(gamma):
            t = tokens[r, j, d]
            q_x[d], p_x[d] = q[r, j, d, t], p[r, j, d, t]
        below[0] = _f32(_mass_below(p[r, j, 0], q[r, j, 0], tokens[r, j, 0]))
        top = _highest_reachable(p_x, q_x, below[0], k, eta[r], slack)
        for d in range(1, top):  # C at the path's rows below level top
            below[d] = _f32(_mass_below(p[r, j, d], q[r, j, d], tokens[r, j, d]))
        # λ_0 = 0, λ_{l+1} = (λ_l + C_l(x)) / q_l(x): gbv.prefix_lambdas
        lam[r, 0] = 0.0
        for d in range(1, min(top + 1, gamma)):
            lam[r, d] = (lam[r, d - 1] + np.float64(below[d - 1])) / np.float64(q_x[d - 1])
        for d in range(top):
            inv, t, scale = _skew_factors(lam[r, d], k)
            q_tilde[d] = _skewed(q_x[d], below[d], inv, t, scale, k)
        _running_products(p_x[:top], q_tilde[:top], pi[r, :top])
        if top == gamma:
            first = _top_level(eta[r], pi[r], slack)
        else:
            first = _next_level(eta[r], pi[r], slack, top + 1)
        tau[r] = gamma if first == gamma else -1
        level[r] = -1 if first == gamma else first


@_jit
def _highest_reachable(p_x, q_x, below_0, k, eta, slack):
    """The highest level that gbv's levels_top_down can reach by upper bounds of the running
    products: γ where η_γ < p_γ is not ruled out, else the highest i < γ where η_i < p_i·slack
    is not (0 where none is). q̃(x_0) is exact (λ_0 = 0); past it λ_{l+1} ≥ λ_l / q_l(x) (C ≥ 0)
    and q̃(x_l) ≥ F(0) q_l(x) at that λ (q̃ grows with C, F with t = λ/(λ+1); the comment
    above _FLOOR_SLACK), and the bounds' products run as block.running_products do:
    p_i = min(1, min over the suffixes ending at i of their products of p/q̃), which only
    grows with each ratio. γ where a ratio is not finite."""
    gamma = p_x.shape[0]
    inv, t, scale = _skew_factors(0.0, k)
    q_tilde_0 = _skewed(q_x[0], below_0, inv, t, scale, k)
    lam = np.float64(below_0) / np.float64(q_x[0])  # λ_1 exactly, then lower bounds
    pi_up = np.empty(gamma)
    running, peak = 0.0, 0.0  # Σ log ratio; max(0, its largest prefix)
    for d in range(gamma):
        if d == 0:
            ratio = np.float64(p_x[0]) / np.float64(q_tilde_0)
        else:
            inv, t, scale = _skew_factors(lam, k)
            ratio = np.float64(p_x[d]) / (_skew_floor(0.0, inv, t, scale, k) * np.float64(q_x[d]))
            lam /= np.float64(q_x[d])
        if not (ratio < np.inf):  # +inf or NaN: no bound
            return gamma
        running += np.log(ratio)
        peak = max(peak, running)
        pi_up[d] = np.exp(running - peak) * _PI_SLACK
    return _top_level(eta, pi_up, slack)


@_jit
def _level_words(
    p, q, path, level, rows, ids, lam, pi, k, eta, slack, words, counts, dead, q_row, lo, hi
):
    """The live sort words of row (path, level) of each request rows[i], over the ids given
    (the draft's support, or every token), in words[i, :counts[i]] and their dead mass in
    dead[i]; +inf into q_row[r] at every id. A level whose test fails by _fails_unranked is
    moved down first (as _gbv_level's failure would), without ranking its row."""
    for i in range(lo, hi):
        r = rows[i]
        while True:
            lvl = level[r]
            at = (r, path[r], lvl)
            pi_lvl = _product_before(pi[r], lvl)
            kappa, dead[i], f = _dead_prefix(p[at], q[at], ids, lam[r, lvl], k, pi_lvl)
            if lvl == 0 or not _fails_unranked(p[at], q[at], kappa, f, pi_lvl, eta[r, lvl - 1]):
                break
            level[r] = _next_level(eta[r], pi[r], slack, lvl)
        counts[i] = _live_words(p[at], q[at], ids, kappa, words[i], q_row[r])


@_jit
def _gbv_level(
    p, q, path, level, rows, words, counts, dead, lam, pi, k, eta, slack, tau, q_row, lo, hi
):
    """One round of levels_top_down for requests rows[i]: q̃ of the row at its level, walked
    up the order of its live tokens (words[i, :counts[i]], sorted) into q_row[r];
    R = Σ(p_i p - q̃)_+ and the test η_i < R / (R + 1 - p_i) (0/0 -> 1). A pass (or level 0)
    sets τ; a failure moves level[r] to the next level η can pass."""
    for i in range(lo, hi):
        r = rows[i]
        lvl = level[r]
        pr, out = p[r, path[r], lvl], q_row[r]
        ranked = words[i, : counts[i]]
        _live_walk(q[r, path[r], lvl], ranked, dead[i], lam[r, lvl], k, out)
        pi_lvl = _product_before(pi[r], lvl)
        h = _level_prob(_residual_mass(pr, out, pi_lvl), pi_lvl)
        if lvl == 0 or eta[r, lvl - 1] < h:
            tau[r] = lvl
        else:
            level[r] = _next_level(eta[r], pi[r], slack, lvl)


@_jit
def _gbv_draw(p, path, tau, pi, q_row, u, y, lo, hi):
    """block.residual_token for requests lo..hi: y ~ (p_τ p - q̃)_+ at τ (p where that is
    all 0; at τ = γ q_row is 0: the bonus token), p_0 = 1."""
    weights = np.empty(p.shape[3], np.float32)
    for r in range(lo, hi):
        pi_tau = _product_before(pi[r], tau[r])
        y[r] = _residual_draw(p[r, path[r], tau[r]], q_row[r], pi_tau, u[r], weights)


def gbv_verify(
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V] float32
    target_probs: torch.Tensor,  # [B, K, γ+1, V] float32
    uniforms: torch.Tensor,  # [B, γ+1]
    support: torch.Tensor | None,  # [V'] ids outside which q is 0 (draft_support), or None
    slack: float,  # levels_top_down's bound on h_i / p_i
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gbv.gbv_verify_lazily at K > 1 as numba loops a request: selection, the path's values and
    λ below the highest level it can reach, then rounds of levels tried top-down, each ranking
    the live tokens of one row per undecided request (numpy's sort of their sort words
    between two loops), then the residual draw. -> τ [B], path [B], y [B] int64."""
    B, K, gamma, V = draft_probs.shape
    tokens, p, q = as_arrays(draft_tokens, target_probs, draft_probs)
    eta = uniforms[:, :gamma].float().numpy()  # compared in the rows' dtype, as the torch ops
    u = uniforms[:, gamma].double().numpy()
    path, tau, level = (np.empty(B, np.int64) for _ in range(3))
    lam, pi = np.empty((B, gamma)), np.empty((B, gamma), np.float32)
    over_requests(_gbv_path, B, p, q, tokens, K, eta, slack, path, lam, pi, tau, level)
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
        over_requests(_level_words, n, *args)
        sort_words(words, counts)
        state = (lam, pi, K, eta, slack, tau, q_row)
        over_requests(_gbv_level, n, p, q, path, level, rows, *ranking, *state)
        rows = rows[tau[rows] < 0]
    y = np.empty(B, np.int64)
    over_requests(_gbv_draw, B, p, path, tau, pi, q_row, u, y)
    return torch.from_numpy(tau), torch.from_numpy(path), torch.from_numpy(y)
