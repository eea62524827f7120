"""Fused row passes for the CPU (numba): SpecTr's ρ* solve, the support check, and the steps
of cpu_verifiers' whole-verifier loops (GBV's ranking words, C at a token and skew walk; the
masses; the sampler's draw).

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


def sort_words(words: np.ndarray) -> None:
    """Sort each row of a 2-D array in place, rows split over torch's thread count."""
    over_row_ranges(lambda lo, hi: words[lo:hi].sort(axis=-1), words.shape[0])


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
def _row_words(p, q, ids, words_id, words_key):
    """The sort words of sorting.ascending_order, (key bits << 32) | id, of the rows p, q [V]
    over the given ids, written through two views of one int64 row: words_id[2j] = ids[j],
    words_key[2j + 1] = its key."""
    for j in range(ids.shape[0]):
        v = ids[j]
        words_id[2 * j] = v
        words_key[2 * j + 1] = _ratio(p[v], q[v])


@_jit
def _ranking_words(p, q, ids, words_id, words_key, lo, hi):
    """_row_words of rows lo..hi of p, q [n, V]."""
    for r in range(lo, hi):
        _row_words(p[r], q[r], ids, words_id[r], words_key[r])


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


@_jit
def _skew_walk(q, ids, lam, k, out):
    """out[v] = q̃(v) of the row q [V'] whose ids ascend by (p/q, id) in ids[0::2]:
    gbv.mass_ranked_below and gbv.skewed_probs in one walk up the order."""
    inv, t, scale = _skew_factors(lam, k)
    running = 0.0  # float64 and sequential: torch's CPU cumsum
    for j in range(ids.shape[0] // 2):
        v = ids[2 * j]
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
    """workers.sampling.sample_from_weights of one row w [V] >= 0: the first index whose
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
def _kseq_f(rho, p_below, q_below, q_total, n, keys, r):
    """top_down.kseq_rho_all's f_beta at one ρ: the sorted ratios below ρ by binary search
    (torch.searchsorted's left side), then f(ρ) and β(ρ)."""
    lo, hi = 0, p_below.shape[0] - 1  # the count of keys below ρ lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if np.float64(keys[r, 2 * mid + 1]) < rho:
            lo = mid + 1
        else:
            hi = mid
    beta = (q_total - q_below[lo]) / q_total + p_below[lo] / rho
    return rho * beta - 1 + max(1 - beta, 0.0) ** n, beta


@_jit
def _kseq_search(p, q, ids, keys, nf, ways, rounds, rho_out, beta_out, lo, hi):
    """top_down.kseq_rho_all after the sort, for rows r whose ids ascend by (p/q, id) in
    ids[r, 0::2] (their keys in keys[r, 1::2]): the prefix masses of p and q in that order
    (float64, sequential), then the same search, probe for probe."""
    V = p.shape[1]
    p_below = np.empty(V + 1)
    q_below = np.empty(V + 1)
    for r in range(lo, hi):
        p_below[0] = q_below[0] = 0.0
        for j in range(V):
            v = ids[r, 2 * j]
            p_below[j + 1] = p_below[j] + np.float64(p[r, v])
            q_below[j + 1] = q_below[j] + np.float64(q[r, v])
        q_total = max(q_below[V], 1e-300)
        n = nf[r]
        low, high = 1.0, n
        for _ in range(rounds):
            # The first of lo, ways - 1 inner points and hi where f >= 0 (at hi it is).
            first = ways
            for i in range(ways):
                if (
                    _kseq_f(low + (high - low) * (i / ways), p_below, q_below, q_total, n, keys, r)[
                        0
                    ]
                    >= 0
                ):
                    first = i
                    break
            before = max(first - 1, 0)
            new_high = high if first == ways else low + (high - low) * (first / ways)
            low = low + (high - low) * (before / ways)
            high = new_high
        rho_out[r] = high
        beta_out[r] = _kseq_f(high, p_below, q_below, q_total, n, keys, r)[1]


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


def _ranked(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows [n, V] sorted by (p/q, id), as int32 and float32 views of the sorted sort words:
    ids[r, 0::2] are row r's ids in that order, keys[r, 1::2] their keys."""
    words = np.empty(p.shape, dtype=np.int64)
    ids, keys = words.view(np.int32), words.view(np.float32)  # little-endian: the id low
    every = np.arange(p.shape[1])
    over_row_ranges(lambda lo, hi: _ranking_words(p, q, every, ids, keys, lo, hi), p.shape[0])
    sort_words(words)
    return ids, keys


def kseq_rho(
    p: torch.Tensor,  # [n, V] float32: target rows
    q: torch.Tensor,  # [n, V] float32: draft rows
    nf: torch.Tensor,  # [n] float64: candidates at each node
    ways: int,
    rounds: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """top_down.kseq_rho_all: the sort words in one pass, numpy's sort, then each row's prefix
    masses and search in one loop. -> ρ* [n] float64, β(ρ*) [n] float64."""
    n = p.shape[0]
    p2, q2 = _rows2d(p), _rows2d(q)
    ids, keys = _ranked(p2, q2)
    rho, beta = np.empty(n), np.empty(n)
    nf64 = nf.double().contiguous().numpy()

    def search(lo, hi):
        _kseq_search(p2, q2, ids, keys, nf64, ways, rounds, rho, beta, lo, hi)

    over_row_ranges(search, n)
    return torch.from_numpy(rho), torch.from_numpy(beta)
