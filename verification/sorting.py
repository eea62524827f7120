"""Row-wise ascending order of a non-negative float32 key, ties by token id.

GBV ranks every token of a row (spec §8) and SpecTr's ρ* solve (§7) needs the masses above and
below any ratio threshold; both need the order of a [N, V] key per row. On CPU, sorting int64
words that hold the key's float32 bits above the token id beats ``torch.sort`` on CPU
(numpy's integer sort; the words are unique, so their integer order is the (key, id)
order and no tie pass is needed), and the rows are split over torch's intra-op threads (numpy's
sort is single-threaded and releases the GIL). Elsewhere a stable ``torch.sort`` of the key
itself gives the same order: a GPU's radix sort then moves 32-bit keys, not 64-bit words.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from .cpu_kernels import sort_words


def ratio_key(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p/q of every token [..., V] in the rows' dtype, +inf where q = 0: the key GBV (§8) and
    SpecTr's ρ* (§7) rank tokens by. Two passes: p/q is already +inf where q = 0 < p, and its
    NaN where p = q = 0 becomes +inf (a select on q > 0 would make a third)."""
    inf = torch.inf
    return torch.nan_to_num(p / q, nan=inf, posinf=inf, neginf=inf)


def sort_ascending(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """key [N, V] -> (the sorted keys [N, V], ascending_order(key)): a sort gives both, and
    gathering the keys again would be one more pass."""
    if _packed_sort_applies(key):
        order = ascending_order(key)
        return key.gather(-1, order), order
    return torch.sort(key, dim=-1, stable=True)


def _packed_sort_applies(key: torch.Tensor) -> bool:
    return key.dtype == torch.float32 and key.device.type == "cpu" and sys.byteorder == "little"


def ascending_order(key: torch.Tensor) -> torch.Tensor:
    """key [N, V] >= 0 (+inf allowed, no NaN) -> token ids [N, V] int64, ascending by (key, id).
    float32 keys on CPU take the packed sort; others a stable ``torch.sort``, the same order
    (the packed words would put a -0.0 key first; a ratio of probabilities is never -0.0)."""
    n, V = key.shape
    if not _packed_sort_applies(key):
        return torch.sort(key, dim=-1, stable=True).indices
    bits = key.contiguous().view(torch.int32)  # non-negative floats order as integers
    words = np.empty((n, V, 2), dtype=np.int32)  # little-endian int64: [low word, high word]
    words[..., 0] = np.arange(V, dtype=np.int32)
    words[..., 1] = bits.numpy()
    packed = words.view(np.int64).reshape(n, V)
    sort_words(packed)
    return torch.from_numpy(packed.view(np.int32)[:, 0::2]).long()
