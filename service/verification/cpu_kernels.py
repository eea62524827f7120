"""Fused row passes for the CPU (numba): GBV's ranking and skew, SpecTr's ρ* solve and
traversal verification's walk.

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
Traversal's walk sums its masses in float64 where torch sums float32: α and the final row
agree to float32's last bits, and a uniform would have to fall that close to its threshold.

The kernels release the GIL; rows are split over a small thread pool (numba's own parallel
layer would be a second thread pool beside torch's). float32 rows only: others take the
torch ops.
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
    """Whether GBV and SpecTr take these kernels for rows: float32 on CPU, contiguous along V."""
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


@numba.njit(**_JIT_OPTIONS, fastmath={"reassoc"})
def _mass_below_at(p, q, rows_p, rows_q, x, out, lo, hi):
    """out[r] = Σ_v q[v] over v ranked below x[r] by (p/q, id), in rows p[rows_p[r]] and
    q[rows_q[r]]. The sum may be reassociated (and so vectorised): 5x faster than in order."""
    V = p.shape[1]
    for r in range(lo, hi):
        pr, qr, t = p[rows_p[r]], q[rows_q[r]], x[r]
        kx = _ratio(pr[t], qr[t])
        total = 0.0
        for v in range(V):
            k = _f32(pr[v] / qr[v])  # 0/0 is NaN here, not +inf: its q adds 0 anyway
            below = (k < kx) | ((k == kx) & (v < t))
            total += np.float64(qr[v]) if below else 0.0
        out[r] = total


@_jit
def _ranking_words(p, q, ids, keys, lo, hi):
    """The sort words of sorting.ascending_order, (key bits << 32) | id, written through two
    views of one int64 array [n, V]: ids[r, 2v] = v, keys[r, 2v + 1] = key(v)."""
    V = p.shape[1]
    for r in range(lo, hi):
        for v in range(V):
            ids[r, 2 * v] = v
            keys[r, 2 * v + 1] = _ratio(p[r, v], q[r, v])


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
def _skew_sorted(q, ids, lam, k, out, lo, hi):
    """out[r] = q̃ of row q[r], whose ids ascend by (p/q, id) in ids[r, 0::2]:
    gbv.mass_ranked_below and gbv.skewed_probs in one walk up the order."""
    V = q.shape[1]
    for r in range(lo, hi):
        inv = _f32(1 / (lam[r] + 1))  # divided through by (λ+1), as skewed_probs
        t = _f32(lam[r] / (lam[r] + 1))
        scale = _power_sum(_f32(1), t, k)
        running = 0.0  # float64 and sequential: torch's CPU cumsum
        for j in range(V):
            v = ids[r, 2 * j]
            qv = q[r, v]
            running += np.float64(qv)
            below = _f32(running - np.float64(qv))
            b = _fma(below, inv, t)  # torch.addcmul(t, below, inv)
            a = _fma(qv, inv, b)
            out[r, v] = _power_sum(a, b, k) * qv / scale


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


def _rows2d(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1, t.shape[-1]).numpy()


def _ranked(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows [n, V] sorted by (p/q, id), as int32 and float32 views of the sorted sort words:
    ids[r, 0::2] are row r's ids in that order, keys[r, 1::2] their keys."""
    words = np.empty(p.shape, dtype=np.int64)
    ids, keys = words.view(np.int32), words.view(np.float32)  # little-endian: the id low
    over_row_ranges(lambda lo, hi: _ranking_words(p, q, ids, keys, lo, hi), p.shape[0])
    sort_words(words)
    return ids, keys


def mass_below_at(
    p: torch.Tensor,  # [N, V] float32: target rows
    q: torch.Tensor,  # [M, V] float32: draft rows
    rows_p: torch.Tensor,  # [n] int64: a row of p per output
    rows_q: torch.Tensor,  # [n] int64: a row of q per output
    x: torch.Tensor,  # [n] int64: a token per output
) -> torch.Tensor:
    """C(x) = Σ q(x') over x' ranked below x by (p/q, id) in the rows p[rows_p], q[rows_q]:
    [n] float64, without a sort or a copy of the rows (gbv.drafted_mass_below)."""
    out = np.empty(x.numel())
    args = (_rows2d(p), _rows2d(q), rows_p.numpy(), rows_q.numpy(), x.numpy(), out)
    over_row_ranges(lambda lo, hi: _mass_below_at(*args, lo, hi), x.numel())
    return torch.from_numpy(out)


def skewed_rows(
    q: torch.Tensor,  # [n, V] float32: draft rows
    p: torch.Tensor,  # [n, V] float32: the target rows at the same prefixes
    lam: torch.Tensor,  # [n] float64: λ of each prefix
    k: int,
) -> torch.Tensor:
    """gbv.skewed_rows without its temporaries: the sort words in one pass, numpy's sort
    (sorting.sort_words), and q̃ written by id in one walk up the order. [n, V] float32."""
    n, V = q.shape
    q2, p2 = _rows2d(q), _rows2d(p)
    ids, _ = _ranked(p2, q2)
    out = np.empty((n, V), dtype=np.float32)
    lam64 = lam.double().contiguous().numpy()
    over_row_ranges(lambda lo, hi: _skew_sorted(q2, ids, lam64, k, out, lo, hi), n)
    return torch.from_numpy(out)


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


@numba.njit(**_JIT_OPTIONS, fastmath={"reassoc"})
def _excess_mass(p, q, alpha):
    """float32 Σ_v (α p[v] - q[v])_+, the products and differences in float32 as torch's
    ops, summed in float64 (reassociated, so vectorised)."""
    total = 0.0
    for v in range(p.shape[0]):
        total += max(np.float64(alpha * p[v] - q[v]), 0.0)
    return _f32(total)


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
def _traversal_walk(p, q, tokens, leaves, branch, log_ratio, u, tau, path_out, row, lo, hi):
    """traversal.traversal_verify's walk for requests lo..hi, one at a time: its segments
    tested top-down, each node's mass summed only when its test is reached (the deepest
    pass wins, so the first from the top does), and only the branch node's rows rewritten.
    Writes τ, the final path and the row y is drawn from."""
    _, K, gamma = tokens.shape
    V = p.shape[3]
    mod_p = np.empty((gamma, V), np.float32)  # the rows deletions rewrote, by depth
    mod_q = np.empty((gamma, V), np.float32)
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
                row[r] = p[r, path, gamma]
            elif depth >= 0:  # the updated row norm((α p - q)_+) (p if 0/0)
                for v in range(V):
                    excess = max(alpha * p_row[v] - q_row[v], _f32(0))
                    row[r, v] = excess / mass if mass > 0 else p_row[v]
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
    """traversal_verify's walk as one loop a request. -> τ [B], path [B], and the row [B, V]
    float32 whose normalised law y is drawn from."""
    B, _, _, V = draft_probs.shape
    tau, path = np.empty(B, np.int64), np.empty(B, np.int64)
    row = np.empty((B, V), np.float32)
    args = [
        t.contiguous().numpy()
        for t in (target_probs, draft_probs, draft_tokens, leaves, branch, log_ratio, uniforms)
    ]

    def walk(lo, hi):
        _traversal_walk(*args, tau, path, row, lo, hi)

    over_row_ranges(walk, B)
    return torch.from_numpy(tau), torch.from_numpy(path), torch.from_numpy(row)
