"""The walks' numba loops, for the numba backend (float32 CPU rows): SpecTr's ρ* solve
(top_down.kseq_rho_all: the masses outside the search's range [1, n] and the sort words of
the tokens inside it in one pass, numpy's sort of those, then each row's prefix masses and
search in one loop), SpecTr's residual draw at the undecided nodes, and token verification's
recovered or bonus token below a one-path node, read in place.

The ρ* search repeats kseq_rho_all's sums and probes; only (1 - β)^n may round apart (torch's
vectorised pow against the compiled one): ρ* equal here, at worst a grid step apart.
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
    _ratio,
    _residual_draw,
    _sort_word,
    as_arrays,
    over_requests,
    over_row_ranges,
    sort_words,
)


@_jit
def _kseq_f(rho, p_below, q_below, q_total, n, keys, r, m):
    """top_down.kseq_rho_all's f_beta at one ρ in [1, n]: the ranked ratios below ρ by binary
    search among the m of row r (torch.searchsorted's left side), then f(ρ) and β(ρ)."""
    lo, hi = 0, m  # the count of ranked keys below ρ lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if np.float64(keys[r, 2 * mid + 1]) < rho:
            lo = mid + 1
        else:
            hi = mid
    beta = (q_total - q_below[lo]) / q_total + p_below[lo] / rho
    return rho * beta - 1 + max(1 - beta, 0.0) ** n, beta


@numba.njit(**_JIT_OPTIONS, fastmath={"reassoc"})
def _kseq_outer_masses(p, q, n):
    """The masses of the rows p, q [V] outside the ρ search's range [1, n] of ratios: P and Q
    of the tokens whose p/q < 1 (below every probe), and Q of those at or above n, 0/0 and
    p/0 included (above every probe: a ratio equal to ρ counts above it). float64,
    reassociated."""
    p_low, q_low, q_high = 0.0, 0.0, 0.0
    for v in range(p.shape[0]):
        key = np.float64(_f32(p[v] / q[v]))
        low, high = key < 1.0, not key < n
        p_low += np.float64(p[v]) if low else 0.0
        q_low += np.float64(q[v]) if low else 0.0
        q_high += np.float64(q[v]) if high else 0.0
    return p_low, q_low, q_high


@_jit
def _kseq_words(p, q, nf, words, counts, outer, lo, hi):
    """For rows r in lo..hi of p, q [n, V]: outer[r] = the masses outside [1, n)
    (_kseq_outer_masses), and the sort words (_sort_word) of the tokens whose ratio
    lies in [1, n), packed at the front of words[r] (counts[r] of them): only those can fall
    on either side of a probe, so only those are ranked."""
    for r in range(lo, hi):
        n = nf[r]
        outer[r, 0], outer[r, 1], outer[r, 2] = _kseq_outer_masses(p[r], q[r], n)
        m = 0
        for v in range(p.shape[1]):  # branch-free: the ranges interleave
            key = _f32(_ratio(p[r, v], q[r, v]))
            words[r, m] = _sort_word(key, v)
            m += np.float64(key) >= 1.0 and np.float64(key) < n
        counts[r] = m


@_jit
def _kseq_search(p, q, ids, keys, counts, outer, nf, ways, rounds, rho_out, beta_out, lo, hi):
    """top_down.kseq_rho_all after the sort, for rows r whose ranked ids ascend by (p/q, id)
    in ids[r, 0:2m:2] (their keys in keys[r, 1::2]): the prefix masses of p and q in that
    order (float64, sequential) on top of the masses below 1, then the same search, probe for
    probe."""
    V = p.shape[1]
    p_below = np.empty(V + 1)
    q_below = np.empty(V + 1)
    for r in range(lo, hi):
        m = counts[r]
        p_below[0], q_below[0] = outer[r, 0], outer[r, 1]
        for j in range(m):
            v = ids[r, 2 * j]
            p_below[j + 1] = p_below[j] + np.float64(p[r, v])
            q_below[j + 1] = q_below[j] + np.float64(q[r, v])
        q_total = max(q_below[m] + outer[r, 2], 1e-300)
        n = nf[r]
        low, high = 1.0, n
        for _ in range(rounds):
            # The first of lo, ways - 1 inner points and hi where f >= 0 (at hi it is).
            first = ways
            for i in range(ways):
                probe = low + (high - low) * (i / ways)
                if _kseq_f(probe, p_below, q_below, q_total, n, keys, r, m)[0] >= 0:
                    first = i
                    break
            before = max(first - 1, 0)
            new_high = high if first == ways else low + (high - low) * (first / ways)
            low = low + (high - low) * (before / ways)
            high = new_high
        rho_out[r] = high
        beta_out[r] = _kseq_f(high, p_below, q_below, q_total, n, keys, r, m)[1]


def _rows2d(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1, t.shape[-1]).numpy()


def kseq_rho(
    p: torch.Tensor,  # [n, V] float32: target rows
    q: torch.Tensor,  # [n, V] float32: draft rows
    nf: torch.Tensor,  # [n] float64: candidates at each node
    ways: int,
    rounds: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """top_down.kseq_rho_all: the masses outside the search's range [1, n] and the sort words
    of the tokens inside it in one pass, numpy's sort of those, then each row's prefix masses
    and search in one loop. -> ρ* [n] float64, β(ρ*) [n] float64."""
    n = p.shape[0]
    p2, q2 = _rows2d(p), _rows2d(q)
    nf64 = nf.double().contiguous().numpy()
    words = np.empty(p2.shape, np.int64)
    counts, outer = np.empty(n, np.int64), np.empty((n, 3))
    over_row_ranges(lambda lo, hi: _kseq_words(p2, q2, nf64, words, counts, outer, lo, hi), n)
    sort_words(words, counts)
    ids, keys = words.view(np.int32), words.view(np.float32)  # little-endian: the id low
    rho, beta = np.empty(n), np.empty(n)

    def search(lo, hi):
        _kseq_search(p2, q2, ids, keys, counts, outer, nf64, ways, rounds, rho, beta, lo, hi)

    over_row_ranges(search, n)
    return torch.from_numpy(rho), torch.from_numpy(beta)


@_jit
def _recovered_draws(p, q, b, k, tau, u, y, lo, hi):
    """token.recovered_token at the rows p[b, k, τ], q[b, k, τ] (p [B, K, γ+1, V],
    q [B, K, γ, V]; q is 0 at τ = γ: the bonus token) for i in lo..hi: y[i] ~ (p - q)_+ (p
    where nothing is left), in its float32 steps."""
    gamma = q.shape[2]
    weights = np.empty(p.shape[3], np.float32)
    no_draft = np.zeros(p.shape[3], np.float32)
    for i in range(lo, hi):
        q_row = q[b[i], k[i], tau[i]] if tau[i] < gamma else no_draft
        y[i] = _residual_draw(p[b[i], k[i], tau[i]], q_row, _f32(1), u[i], weights)


@_jit
def _kseq_draws(p, q, rows, rho, scale, u, y, lo, hi):
    """top_down.spectr_rule's residual draw at rows[i] of p, q [n, V] for i in lo..hi:
    y[i] ~ (p - min(q, p/ρ)·scale)_+ (p where nothing is left), ρ and scale float32, in the
    torch ops' float32 steps."""
    weights = np.empty(p.shape[1], np.float32)
    for i in range(lo, hi):
        r = rows[i]
        positive = False
        for v in range(p.shape[1]):
            w = p[r, v] - min(q[r, v], p[r, v] / rho[r]) * scale[r]
            weights[v] = max(w, _f32(0))
            positive |= w > 0
        y[i] = _draw(weights if positive else p[r], u[r])


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
    inputs = as_arrays(target_probs, draft_probs, b, k, tau, u.double())
    over_requests(_recovered_draws, b.shape[0], *inputs, y)
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
    inputs = as_arrays(p_row, q_row, rows, rho.float(), scale.float(), u.double())
    over_requests(_kseq_draws, rows.shape[0], *inputs, y)
    return torch.from_numpy(y)
