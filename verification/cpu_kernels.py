"""Fused row passes for the CPU (numba): SpecTr's ρ* solve, the support check, and the
whole-verifier loops of GBV, traversal, greedy BV / SpecTr-GBV* and their carried records that
cpu_verifiers drives (with their steps: the ranking words, C at a token, the live tokens'
words and walk, the masses, M_new, the sampler's draw).

In torch ops every elementwise step over a [rows, V] block is a pass over memory and a fresh
temporary (on this VM mostly page faults): C(x_i), the q-mass ranked below a drafted token,
took a division, a NaN fix, three comparisons, two logical ops, a product and a sum per row,
and a skewed row (the ranking key, the packed sort words, the running sum, a scatter and the
skew's six products) about fifteen; SpecTr's ρ* search ~400 small ops after the sort. These
kernels read each row once and keep the rest in registers: the CPU's counterpart of the
Triton kernels in ``kernels.py``.

Bit for bit where the math is elementwise: the skew repeats the torch ops' float32 steps in
their order (an FMA where torch's addcmul is one, as its compiler builds it here; nothing else
contracted, as numba compiles without fast-math), and the running sum is float64 and
sequential like torch's CPU ``cumsum``. C(x_i) is summed in float64 in whatever order the
compiler vectorises (``torch.sum`` has its own): the totals can differ in their last bits,
and the float32 C that GBV uses only where a total lies that close to a float32 rounding
boundary (~1e-7 of values at most; no seeded output in the benchmarks changed). The ρ*
search repeats top_down.kseq_rho_all's sums and probes; only (1 - β)^n may round apart
(torch's vectorised pow against the compiled one): ρ* equal here, at worst a grid step apart.

The kernels release the GIL; rows are split over a small thread pool (numba's own parallel
layer would be a second thread pool beside torch's). float32 rows only: others take the
torch ops. After a torch op wide enough to run in parallel, torch's OpenMP workers spin for
milliseconds (libgomp's default wait policy) on the cores this pool needs: one such op (the
support check's comparison of one row of 49,152) made a GBV call at B = 8, K = 2 take 12.9 ms
instead of 8.7. So the CPU paths keep such ops away from these kernels (draft_support below).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import numba
import numba.extending
import numpy as np
import torch

_THREADS = 4
_POOL = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="row-kernel")


def over_row_ranges(fn, n: int) -> None:
    """fn(lo, hi) on consecutive parts of range(n), one per torch intra-op thread (at most
    _THREADS): for numpy and numba work that releases the GIL."""
    parts = min(torch.get_num_threads(), _THREADS, n)
    if parts <= 1:
        fn(0, n)
        return
    bounds = np.linspace(0, n, parts + 1).astype(int)
    list(_POOL.map(lambda i: fn(bounds[i], bounds[i + 1]), range(parts)))


def sort_words(words: np.ndarray, counts: np.ndarray | None = None) -> None:
    """Sort each row of a 2-D array in place (its first counts[i] elements, if given), rows
    split over torch's thread count."""
    if counts is None:
        over_row_ranges(lambda lo, hi: words[lo:hi].sort(axis=-1), words.shape[0])
        return

    def sort_prefixes(lo, hi):
        for i in range(lo, hi):
            words[i, : counts[i]].sort()

    over_row_ranges(sort_prefixes, words.shape[0])


def applies(*rows: torch.Tensor) -> bool:
    """Whether the verifiers take these kernels for rows: float32 on CPU, contiguous along V."""
    return sys.byteorder == "little" and all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in rows
    )


# Compiled on first use and cached on disk next to this module. error_model="numpy": x/0 is
# ±inf or NaN, as in torch, not an exception.
_JIT_OPTIONS = dict(nogil=True, cache=True, boundscheck=False, error_model="numpy")
_jit = numba.njit(**_JIT_OPTIONS)
_f32 = np.float32
_INF = np.float32(np.inf)


@numba.extending.intrinsic
def _fma(typingctx, a, b, c):
    """a·b + c rounded once: torch's CPU addcmul (its compiler contracts it to an FMA)."""
    f32 = numba.types.float32

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return f32(f32, f32, f32), codegen


@_jit
def _ratio(p, q):
    """The ranking key: float32 p/q, +inf for 0/0 (sorting.ratio_key)."""
    k = _f32(p / q)
    return _INF if k != k else k


@_jit
def _sort_word(key, v):
    """The sort word of token v of key p/q (>= 0, float32) as sorting.ascending_order packs
    it, (key bits << 32) | id: the words' integer order is the (key, id) order."""
    return (np.int64(_f32(key).view(np.int32)) << 32) | v


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
    reads the rows directly (a gather of each element is 2x slower)."""
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
    be reassociated (and so vectorised): 5x faster than in order."""
    kx = _ratio(p[x], q[x])
    total = 0.0
    for v in range(p.shape[0]):
        k = _f32(p[v] / q[v])  # 0/0 is NaN here, not +inf: its q adds 0 anyway
        below = (k < kx) | ((k == kx) & (v < x))
        total += np.float64(q[v]) if below else 0.0
    return total


@numba.njit(**_JIT_OPTIONS, fastmath={"reassoc"})
def _excess_mass(p, q, alpha):
    """float32 Σ_v (α p[v] - q[v])_+, the products and differences in float32 as torch's
    ops, summed in float64 (reassociated, so vectorised)."""
    total = 0.0
    for v in range(p.shape[0]):
        total += max(np.float64(alpha * p[v] - q[v]), 0.0)
    return _f32(total)


@numba.njit(**_JIT_OPTIONS, fastmath={"reassoc"})
def _residual_mass(p, q, pi):
    """block.residual_mass of one row: -Σ_v min(q[v] - p_i p[v], 0) with the product fused as
    torch's addcmul does it, summed in float64 (reassociated, so vectorised) -> float32."""
    total = 0.0
    for v in range(p.shape[0]):
        total -= min(np.float64(_fma(-p[v], pi, q[v])), 0.0)
    return _f32(total)


@_jit
def _draw(w, u):
    """tensors.sample_from_weights of one row w [V] >= 0: the first index whose
    float64 running sum (sequential, as torch's CPU cumsum) exceeds u·total, kept below the
    total."""
    total = 0.0
    for v in range(w.shape[0]):
        total += np.float64(w[v])
    target = min(np.float64(u) * total, np.nextafter(total, 0.0))
    running = 0.0
    for v in range(w.shape[0]):
        running += np.float64(w[v])
        if running > target:
            return v
    return w.shape[0]


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


@_jit
def _positive_columns(rows, out, lo, hi):
    """out[v] |= rows[r, v] > 0 for rows lo..hi."""
    for r in range(lo, hi):
        for v in range(rows.shape[1]):
            out[v] |= rows[r, v] > 0


def draft_support(rows: torch.Tensor, most: float) -> torch.Tensor | None:
    """common.draft_support of float32 rows [N, V] on CPU: the ids [V'] where some row is
    positive, or None where the first row alone has more than ``most``."""
    rows = rows.numpy()
    if np.count_nonzero(rows[0] > 0) > most:
        return None
    seen = []  # one mask a thread, then their union

    def mark(lo, hi):
        mask = np.zeros(rows.shape[1], np.bool_)
        _positive_columns(rows, mask, lo, hi)
        seen.append(mask)

    over_row_ranges(mark, rows.shape[0])
    ids = np.flatnonzero(np.logical_or.reduce(seen))
    return torch.from_numpy(ids) if 0 < ids.size <= most else None


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


# Whole-verifier loops, one request at a time (driven by cpu_verifiers). They live in this file
# because numba's on-disk cache is keyed on each function's own source file: a loop compiled
# in another file against a step here would keep the old step after this file changed.


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


@_jit
def _running_products(p_x, q_x, pi):
    """block.running_products in float32: p_i = min(1, p_{i-1} p(x_i)/q(x_i)) for the path's
    p(x_i), q(x_i) [γ], as the clipped running sum of float32 log ratios (the sum float64, as
    torch's CPU cumsum)."""
    running, peak = 0.0, _f32(-np.inf)
    for d in range(p_x.shape[0]):
        running += np.float64(np.log(p_x[d]) - np.log(q_x[d]))
        s = _f32(running)
        if s >= peak or s != s:
            peak = s
        pi[d] = np.exp(s - (peak if (peak > 0 or peak != peak) else _f32(0)))


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
def _next_level(eta, pi, slack, below):
    """The highest level i < below that η [γ] can pass under the running products pi [γ]:
    η_i < p_i·slack (level 0 always)."""
    i = below - 1
    while i > 0 and not np.float64(eta[i - 1]) < np.float64(pi[i - 1]) * slack:
        i -= 1
    return i


@_jit
def _top_level(eta, pi, slack):
    """levels_top_down's first level: γ where η_γ < p_γ, else _next_level below γ."""
    gamma = eta.shape[0]
    return gamma if eta[gamma - 1] < pi[gamma - 1] else _next_level(eta, pi, slack, gamma)


@_jit
def _product_before(pi, level):
    """p_i of the level: the running product pi [γ] of the tokens below it (1 at level 0)."""
    return _f32(1) if level == 0 else pi[level - 1]


@_jit
def _level_prob(mass, pi_level):
    """Block verification's h_i = R_i / (R_i + 1 - p_i) in float32 steps (0/0 -> 1)."""
    denom = mass + _f32(1) - pi_level
    return mass / denom if denom > 0 else _f32(1)


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


@_jit
def _residual_draw(p_row, q_row, pi_tau, u, weights):
    """block.residual_token of one request: y ~ (p_τ p - q)_+ (p where that is all 0)."""
    positive = False
    for v in range(p_row.shape[0]):
        w = pi_tau * p_row[v] - q_row[v]
        weights[v] = max(w, _f32(0))
        positive |= w > 0
    return _draw(weights if positive else p_row, u)


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


@numba.njit(**_JIT_OPTIONS, fastmath={"reassoc"})
def _offset_mass(p, q, t):
    """modification.residual_mass of one row: Σ_v (p[v] - t q[v])_+ with the product fused as
    torch's addcmul does it, summed in float64 (reassociated, so vectorised) -> float32."""
    total = 0.0
    for v in range(p.shape[0]):
        total += max(np.float64(_fma(-q[v], t, p[v])), 0.0)
    return _f32(total)


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


_ROW_SCALAR_MAX = float(np.finfo(np.float32).max) / 4  # modification.as_row_scalars' clamp


@_jit
def _row_scalar(x):
    """modification.as_row_scalars for float32 rows: float64 -> float32, clamped finite."""
    return _f32(min(x, _ROW_SCALAR_MAX))


@_jit
def _m_new(p, q, t, z, log_p, log_q, t_max):
    """modification.m_new of one row (p - t q)_+ / z with prefix joints log_p, log_q: the new
    (t, z), or the old where no mass is left or P(v) = 0."""
    if not log_p > -np.inf:
        return t, z
    t_new = min(t + z * np.exp(log_q - log_p), t_max)
    z_new = np.float64(_offset_mass(p, q, _row_scalar(t_new)))
    return (t_new, z_new) if z_new > 0 else (t, z)


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


@_jit
def _apply_records(p, q, tokens, log_p, log_q, rows_left, t_max, t, z, base_t, base_z, lo, hi):
    """modification.apply_records for requests lo..hi: every record, oldest first, M_new of
    the rows in its window only (the torch ops pass over the widest window of the batch and
    mask). Writes the modified rows t, z [K, γ] and each record's base rows [R, K, γ].

    Row by row, every record in turn: a row's M_new under record r needs only that row's state
    before r and the path's prefix joints under the same records (`below`, one per record), so
    all of a row's passes over V run while the row is in cache. Record by record they streamed
    every row of the request from memory once a record. The same operations on the same
    values as record by record: the same bits."""
    _, K, gamma = tokens.shape
    R = rows_left.shape[1]
    below = np.empty(R)  # log P of the path's prefix under the rows before each record
    for r in range(lo, hi):
        for j in range(K):
            below[:] = 0.0
            joint_q = 0.0  # log Q of the path's prefix
            for i in range(gamma):
                x = tokens[r, j, i]
                p_x, q_x = np.float64(p[r, j, i, x]), np.float64(q[r, j, i, x])
                row_t, row_z = 0.0, 1.0
                for rec in range(R):
                    base_t[r, rec, j, i], base_z[r, rec, j, i] = row_t, row_z
                    if i >= rows_left[r, rec]:  # beyond the record's window
                        continue
                    prob = max(p_x - row_t * q_x, 0.0) / row_z
                    row_t, row_z = _m_new(
                        p[r, j, i], q[r, j, i], row_t, row_z, log_p[r, rec] + below[rec],
                        log_q[r, rec] + joint_q, t_max,
                    )  # fmt: skip
                    below[rec] += np.log(prob)
                t[r, j, i], z[r, j, i] = row_t, row_z
                joint_q += np.log(q_x)
