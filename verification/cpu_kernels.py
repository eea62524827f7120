"""The CPU's compiled steps that several verifiers share (numba), the support check, the
carried records' application, and the thread pool and cache rules of every numba loop.

Each verifier keeps its own loops beside its torch ops (block/loops.py, gbv/loops.py,
greedy/loops.py, top_down/loops.py, traversal/loops.py); they are the numba backend's. This
module holds what more than one of them compiles in: the ranking key and sort words, the
sampler's draw, block verification's running products, levels and residual masses (GBV's
too), M_new of a modified row (greedy BV's and the records'), and the records' application
itself (modification.apply_records on the numba backend).

In torch ops every elementwise step over a [rows, V] block is a pass over memory and a fresh
temporary (on CPU mostly page faults): C(x_i), the q-mass ranked below a drafted token,
took a division, a NaN fix, three comparisons, two logical ops, a product and a sum per row,
and a skewed row (the ranking key, the packed sort words, the running sum, a scatter and the
skew's six products) about fifteen; SpecTr's ρ* search ~400 small ops after the sort. The
kernels read each row once and keep the rest in registers: the CPU's counterpart of the
Triton kernels in ``kernels.py``.

Bit for bit where the math is elementwise: the skew repeats the torch ops' float32 steps in
their order (an FMA where torch's addcmul is one, as its compiler builds it here; nothing else
contracted, as numba compiles without fast-math), and the running sum is float64 and
sequential like torch's CPU ``cumsum``. C(x_i) is summed in float64 in whatever order the
compiler vectorises (``torch.sum`` has its own): the totals can differ in their last bits,
and the float32 C that GBV uses only where a total lies that close to a float32 rounding
boundary (~1e-7 of values at most; no seeded output in the benchmarks changed). Generally the
loops' sums (a node's mass, C at a drafted token, the sampler's running total) are float64 in
their own order and exp/log come from libm, so a test or a draw whose uniform lies within a
few float32 ulps of its threshold could go the other way; the tests compare their tokens with
the torch ops' on every regime.

The kernels release the GIL; rows (or requests) are split over a small thread pool (numba's
own parallel layer would be a second thread pool beside torch's). After a torch op wide
enough to run in parallel, torch's OpenMP workers spin for milliseconds (libgomp's default
wait policy) on the cores this pool needs: one such op (the support check's comparison of one
row of 49,152) made a GBV call at B = 8, K = 2 take 12.9 ms instead of 8.7. So the CPU paths
keep such ops away from these kernels (draft_support below).

Caching: numba caches a function's machine code on disk, keyed on its own source file's
hash. A loop in a verifier's loops.py compiles the helpers it calls from here into its own
code, so a change here must invalidate its cache too: _SharedKernelsStamp keys those files'
caches on this file's hash as well (each loops.py imports only from here, no other compiled
file). It relies on numba's cache locator list (numba.core.caching, pinned to 0.68 in
pyproject.toml) and is bypassed where NUMBA_CACHE_LOCATOR_CLASSES replaces that list.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numba
import numba.extending
import numpy as np
import torch
from numba.core import caching

_PACKAGE = Path(__file__).resolve().parent
_STAMP = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


class _SharedKernelsStamp(caching._CacheLocator):
    """The locator numba would pick for a function of a verifier's loops.py, with this file's
    hash added to its source stamp (see the module's docstring)."""

    wraps_numba_locators = True  # each loaded copy of this module (a revision's) adds one

    def __init__(self, inner: caching._CacheLocator):
        self._inner = inner

    def ensure_cache_path(self):
        self._inner.ensure_cache_path()

    def get_cache_path(self):
        return self._inner.get_cache_path()

    def get_source_stamp(self):
        # The module's name too: a cached function imports its module by the name it was
        # compiled under, and one under another name loads this file a second time.
        return (self._inner.get_source_stamp(), _STAMP, __name__)

    def get_disambiguator(self):
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        path = Path(py_file).resolve()
        if path.name != "loops.py" or path.parent.parent != _PACKAGE:
            return None
        for locator in caching.CacheImpl._locator_classes:
            if getattr(locator, "wraps_numba_locators", False):
                continue  # this class, or another copy's: wrapping it would recurse
            inner = locator.from_function(py_func, py_file)
            if inner is not None:
                return cls(inner)
        return None


caching.CacheImpl._locator_classes.insert(0, _SharedKernelsStamp)


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
def _residual_draw(p_row, q_row, pi_tau, u, weights):
    """block.residual_token of one request: y ~ (p_τ p - q)_+ (p where that is all 0)."""
    positive = False
    for v in range(p_row.shape[0]):
        w = pi_tau * p_row[v] - q_row[v]
        weights[v] = max(w, _f32(0))
        positive |= w > 0
    return _draw(weights if positive else p_row, u)


@numba.njit(**_JIT_OPTIONS, fastmath={"reassoc"})
def _offset_mass(p, q, t):
    """modification.residual_mass of one row: Σ_v (p[v] - t q[v])_+ with the product fused as
    torch's addcmul does it, summed in float64 (reassociated, so vectorised) -> float32."""
    total = 0.0
    for v in range(p.shape[0]):
        total += max(np.float64(_fma(-q[v], t, p[v])), 0.0)
    return _f32(total)


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


def as_arrays(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The loops' inputs as numpy arrays (contiguous; no copy where they already are)."""
    return [t.contiguous().numpy() for t in tensors]


def over_requests(loop, n: int, *args) -> None:
    """loop(*args, lo, hi) on consecutive ranges of n requests, split over the kernels' pool
    (a loop allocates its own scratch: the ranges run at once)."""
    over_row_ranges(lambda lo, hi: loop(*args, lo, hi), n)


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
    inputs = as_arrays(target_probs, draft_probs, tokens, log_p.double(), log_q.double(), rows_left)
    t, z = np.empty((B, P, L)), np.empty((B, P, L))
    base_t, base_z = np.empty((B, R, P, L)), np.empty((B, R, P, L))
    over_requests(_apply_records, B, *inputs, t_max, t, z, base_t, base_z)
    return tuple(torch.from_numpy(a) for a in (t, z, base_t, base_z))
