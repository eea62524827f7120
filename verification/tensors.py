"""Tensor helpers of the verifiers that the workers share: the float64 running sum, the one
sampler of the project (inverse CDF with uniforms the caller drew), the counter-based uniforms
the draft and the engine's verifier calls draw, and row gathers.

They are pure math on tensors, so they live here, below both: the draft's sampling
(workers/sampling.py) and the target's path rows (workers/target.py) import them.
"""

from __future__ import annotations

import numpy as np
import torch

# Off the CPU, rows longer than this are summed up in chunks of it (cumsum64).
SCAN_CHUNK = 256


def cumsum64(x: torch.Tensor) -> torch.Tensor:
    """Running sums of x [..., V] along the last dim, in float64 (no drift over large V).

    On CPU one sequential scan. A GPU scans each row with one thread block, so a few long rows
    leave most multiprocessors idle: there the rows are scanned as chunks of SCAN_CHUNK, all at once
    (chunked_cumsum64)."""
    if x.device.type == "cpu" or x.shape[-1] <= SCAN_CHUNK:
        return x.cumsum(-1, dtype=torch.float64)
    return chunked_cumsum64(x, SCAN_CHUNK)


def chunked_cumsum64(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """cumsum64 as a scan within chunks of ``chunk`` elements, each plus the running total of
    the chunks before it (the chunk totals' own scan, shifted by one). The same sums up to
    rounding: float64 sums of float32 values are exact unless their magnitudes span more than
    ~2^29, and a GPU's own scan associates differently anyway."""
    V = x.shape[-1]
    if V % chunk:  # zeros: the total repeats (no copy where V divides into chunks)
        x = torch.nn.functional.pad(x, (0, -V % chunk))
    within = x.reshape(*x.shape[:-1], -1, chunk).cumsum(-1, dtype=torch.float64)  # [..., C, L]
    ends = within[..., -1].cumsum(-1)  # [..., C]: the total up to the end of each chunk
    before = torch.nn.functional.pad(ends[..., :-1], (1, 0))
    return (within + before.unsqueeze(-1)).flatten(-2)[..., :V]


def sample_from_weights(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample of one index per row of non-negative ``weights`` [N, V] with u [N].

    Rows need not be normalised but must have positive mass. No host synchronisation.
    """
    cdf = cumsum64(weights).contiguous()  # [N, V]: searchsorted reads contiguous rows
    total = cdf[:, -1:]
    # Keep the target strictly below the total: searchsorted(right=True) then returns the first
    # index whose cdf exceeds it, which always has positive weight.
    target = torch.minimum(
        u.to(torch.float64).unsqueeze(-1) * total, total.nextafter(total.new_zeros(()))
    )
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [B, L, ...], index [B, ...] int64 in [0, L) -> rows[b, index[b, ...]]: [B, ..., ...]
    (index's dims, then the rows' own).

    One index_select over the B·L rows, which copies whole rows: advanced indexing
    ``rows[arange(B), index]`` gives the same values but slower on CPU (it gathers element by
    element). Rows whose B and L dims do not merge without a copy take advanced indexing."""
    B, L = rows.shape[:2]
    extra = [1] * (index.dim() - 1)  # index dims past B
    if rows.stride(0) != rows.stride(1) * L:
        return rows[torch.arange(B, device=rows.device).view(B, *extra), index]
    starts = torch.arange(0, B * L, L, device=rows.device)  # row of (b, 0) in the B·L rows
    if not extra:  # [B] (take_rows): no reshapes, each one an op a verifier's budget counts
        return rows.flatten(0, 1).index_select(0, starts + index)
    flat = rows.flatten(0, 1).index_select(0, (starts.view(B, *extra) + index).flatten())
    return flat.view(*index.shape, *rows.shape[2:])


def rows_at(
    rows: torch.Tensor,  # [B, K, D, V]
    b: torch.Tensor,  # [n] int64
    k: torch.Tensor | int,  # [n] int64 or one index for all
    d: torch.Tensor | int,  # [n] int64 or one index for all
) -> torch.Tensor:
    """rows[b, k, d]: [n, V] for requests b (any subset), paths k and depths d: one
    index_select over the B·K·D rows, as in :func:`gather_rows`; rows that are not contiguous
    (merging their dims would copy them all) take advanced indexing."""
    B, K, D, V = rows.shape
    if not rows.is_contiguous():
        return rows[b, k, d]
    return rows.view(B * K * D, V).index_select(0, (b * K + k) * D + d)


# splitmix64 (Steele, Lea & Flood 2014), a bijective 64-bit finaliser, in numpy's uint64 (its
# arithmetic wraps mod 2^64 and its shifts are logical). The counters are hashed on the host,
# once a step, where these ~15 numpy ops take ~25 µs and the same int64 torch ops took ~90.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """uint64 [...] -> uint64 [...]: splitmix64's output for state x (elementwise)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def counter_uniforms(
    key: torch.Tensor,  # int64 on the host, broadcast with the others: a stream's key
    counter: torch.Tensor,  # int64: which draw of the stream (a step's root position)
    index: torch.Tensor,  # int64: which number of that draw
) -> torch.Tensor:
    """Float64 uniforms in [0, 1) on the host, u = hash(key, counter, index) (broadcast shape;
    the int64s taken as their bits): the same bits whenever, wherever and beside whatever they
    are drawn, and no state to keep or ship (Philox-style counters, splitmix64 as the mixer)."""
    k, c, i = (t.numpy().view(np.uint64) for t in (key, counter, index))
    h = splitmix64(splitmix64(splitmix64(k) ^ c) ^ i)
    # the top 53 bits: every double in [0, 1) of the grid
    return torch.from_numpy((h >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def keyed_uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """keys [B, 2] int64 on the host, (key, counter) per request -> [B, n] float64 uniforms
    on the host: request b's j-th number is counter_uniforms(key_b, counter_b, j)."""
    index = torch.arange(n, dtype=torch.int64)
    return counter_uniforms(keys[:, :1], keys[:, 1:], index[None])
