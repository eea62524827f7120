"""Input checks, randomness and the tensor steps the verifiers share (their vocabulary, accepted
/ recovered / bonus, is defined in :mod:`verification`; their sampling is
:func:`verification.tensors.sample_from_weights`).

Every verifier consumes a fixed number of uniforms per request, drawn up front from that
request's own generator, so a request's result never depends on the other requests in its
batch (see :func:`draw_uniforms`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import cpu_kernels
from .backends import Backend
from .tensors import gather_rows, keyed_uniforms

# Rows handed to a verifier must sum to 1 within this tolerance. float32 softmax rows sum to 1
# within ~1e-6 and half-precision rows within ~1e-3; anything further off is not a distribution.
ROW_SUM_TOL = 1e-3


@dataclass(frozen=True)
class CounterDraws:
    """Per-request counter keys in place of generators: request b's uniforms are
    counter_uniforms(key_b, counter_b, j) for j < n (verification/tensors.py). Nothing is
    consumed, so there is no state to keep or ship, and a request's draws depend on nothing
    but its key and counter (the engine: a key from the request's seed, the step's root
    position)."""

    keys: torch.Tensor  # [B, 2] int64: (key, counter) per request, on the host


Generators = torch.Generator | Sequence[torch.Generator] | CounterDraws | None


def check_inputs(
    method: str,
    single_path: bool,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    validate_values: bool,
    check_tokens: bool = True,
) -> None:
    """Raise ValueError naming the problem; never repair the input silently. check_tokens
    False: the caller checks the draft tokens' range itself (without a host read)."""
    if draft_tokens.dim() != 3:
        raise ValueError(f"draft_tokens must be [B, K, γ], got shape {tuple(draft_tokens.shape)}")
    if draft_tokens.dtype != torch.int64:
        raise ValueError(f"draft_tokens must be int64, got {draft_tokens.dtype}")
    B, K, gamma = draft_tokens.shape
    if B < 1 or K < 1 or gamma < 1:
        raise ValueError(f"draft_tokens needs B, K, γ >= 1, got {tuple(draft_tokens.shape)}")
    if draft_probs.dim() != 4 or tuple(draft_probs.shape[:3]) != (B, K, gamma):
        raise ValueError(
            f"draft_probs must be [B, K, γ, V] = [{B}, {K}, {gamma}, V], "
            f"got {tuple(draft_probs.shape)}"
        )
    V = draft_probs.shape[-1]
    if tuple(target_probs.shape) != (B, K, gamma + 1, V):
        raise ValueError(
            f"target_probs must be [B, K, γ+1, V] = [{B}, {K}, {gamma + 1}, {V}], "
            f"got {tuple(target_probs.shape)}"
        )
    for name, t in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating dtype, got {t.dtype}")
    if not (draft_tokens.device == draft_probs.device == target_probs.device):
        raise ValueError("draft_tokens, draft_probs and target_probs must be on one device")
    if single_path and K != 1:
        raise ValueError(f"method {method!r} verifies a single path: K must be 1, got K={K}")
    if check_tokens and bool(((draft_tokens < 0) | (draft_tokens >= V)).any()):  # one sync
        raise ValueError(f"draft_tokens must lie in [0, V={V})")
    if not validate_values:
        return
    for name, t in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        sums = t.sum(-1, dtype=torch.float64)
        if not bool(torch.isfinite(sums).all()):
            raise ValueError(f"{name} contains NaN or infinite probabilities")
        if float(t.amin()) < 0:
            raise ValueError(f"{name} contains negative probabilities")
        worst = float((sums - 1).abs().max())
        if worst > ROW_SUM_TOL:
            raise ValueError(
                f"{name} rows must sum to 1 within {ROW_SUM_TOL:g}; worst row is off by {worst:.3g}"
            )
    q_drafted = draft_probs.gather(-1, draft_tokens.unsqueeze(-1))
    if bool((q_drafted <= 0).any()):
        raise ValueError(
            "a drafted token has draft probability q = 0: the draft did not sample from the "
            "draft_probs it reported (the pipeline is inconsistent)"
        )


# A fresh temporary larger than glibc's mmap threshold (32 MiB at most) arrives as new pages on
# every call, and zeroing them can cost more than the arithmetic on them. On CPU, row-wise work
# therefore runs over batch chunks of about this many elements: temporaries are recycled by
# the heap and stay in cache. The size is the best of a sweep over blockspec-bench verify's
# shapes (docs/verification_benchmark.md).
CPU_CHUNK_ELEMS = 1 << 19  # 2 MiB of float32


def over_batch_chunks(fn: Callable, *args, item_numel: int | None = None):
    """``fn(*args)`` on slices of the leading (batch) dim of every tensor argument, results
    (a tensor or a tuple of them) concatenated along it. ``item_numel``: elements ``fn`` works
    on per request (default: those of the first tensor argument). One call off the CPU, where
    each launch costs more than memory traffic."""
    first = next(a for a in args if isinstance(a, torch.Tensor))
    batch = first.shape[0]
    per_item = item_numel if item_numel is not None else first.numel() // max(batch, 1)
    step = max(1, CPU_CHUNK_ELEMS // max(per_item, 1))
    if first.device.type != "cpu" or step >= batch:
        return fn(*args)
    parts = [
        fn(*(a[i : i + step] if isinstance(a, torch.Tensor) else a for a in args))
        for i in range(0, batch, step)
    ]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(column) for column in zip(*parts, strict=True))
    return torch.cat(parts)


def draw_uniforms(generator: Generators, batch: int, n: int, device: torch.device) -> torch.Tensor:
    """[B, n] float64 uniforms in [0, 1).

    ``generator`` is None (torch's default generator), one ``torch.Generator`` shared by the
    batch, a sequence of B generators, one per request, or CounterDraws. With one generator per
    request each request draws exactly ``n`` numbers from its own stream, and ``n`` depends only
    on the method, K and γ: a request's result is then independent of its batch-mates. With
    CounterDraws it is too, and its j-th number does not even depend on ``n``.
    """
    if isinstance(generator, CounterDraws):  # hashed on the host, then one copy (where ~30
        keys = generator.keys  # small kernels would launch on an accelerator)
        if keys.shape != (batch, 2):
            raise ValueError(
                f"generator: expected [{batch}, 2] counter keys, got {list(keys.shape)}"
            )
        return keyed_uniforms(keys, n).to(device, non_blocking=True)
    if generator is None or isinstance(generator, torch.Generator):
        gen_device = generator.device if generator is not None else torch.device("cpu")
        u = torch.rand(batch, n, generator=generator, dtype=torch.float64, device=gen_device)
        return u.to(device, non_blocking=True)
    if len(generator) != batch:
        raise ValueError(
            f"generator: expected {batch} per-request generators, got {len(generator)}"
        )
    rows = [torch.rand(n, generator=g, dtype=torch.float64, device=g.device) for g in generator]
    if all(r.device.type == "cpu" for r in rows):  # one copy that waits for nothing
        return torch.stack(rows).to(device, non_blocking=True)
    return torch.stack([r.to(device) for r in rows])


def positive_part_or(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Clamp ``weights`` at 0; rows with no mass left take ``fallback`` (same shape).

    A zero residual happens only on probability-0 branches (spec §11), so the fallback never
    changes the output law; it only keeps every row a valid distribution.
    """
    w = weights.clamp_min(0)
    return torch.where(w.sum(-1, keepdim=True) > 0, w, fallback)


# Index of every row of a batch: a view, where an index tensor of all rows would be a gather.
ALL = slice(None)


# Rank only the draft's support when it is at most this share of the vocabulary.
SUPPORT_SHARE = 0.5


def draft_support(q: torch.Tensor, backend: Backend) -> torch.Tensor | None:
    """Ids [V'] (ascending) outside which every row of q [..., V] is 0, when they are few:
    a draft with a reduced head (the default pair's keeps 8,192 of 49,152 tokens) or top-k.
    Methods that rank a row's tokens by p/q (GBV, SpecTr's ρ*) rank only these: the others
    have ratio +inf and rank last, by id, and carry no q mass. On the host backends only: the
    count is a host read, free there and a wait on an accelerator."""
    rows = q.flatten(0, -2)  # [N, V]
    most = SUPPORT_SHARE * rows.shape[-1]
    if not backend.reads_host or not rows.shape[0]:
        return None
    if backend.compiled_loops:  # no torch op wide enough to wake its thread pool (see there)
        return cpu_kernels.draft_support(rows, most)
    if int((rows[0] > 0).sum()) > most:
        return None  # a dense first row settles it for one row's cost
    ids = (rows > 0).any(0).nonzero().squeeze(-1)
    return ids if 0 < ids.numel() <= most else None


def support_holding(support: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """support [V'] (draft_support's) if it holds every drafted token of x [...], else None:
    ranking the support alone needs them in it. A drafted token with q = 0 (an unvalidated,
    inconsistent call) ranks the whole vocabulary instead."""
    if support is None:
        return None
    cols = torch.searchsorted(support, x.reshape(-1)).clamp_max(support.numel() - 1)
    return support if bool((support[cols] == x.reshape(-1)).all()) else None


def take_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [B, L, ...], index [B] -> rows[b, index[b]]: [B, ...]; a view when L = 1 (index can
    only be 0: a single path is never copied)."""
    return rows[:, 0] if rows.shape[1] == 1 else gather_rows(rows, index)


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L+1] with out[..., 0] = 0 (joint log-probabilities of prefixes)."""
    return torch.cat([torch.zeros_like(x[..., :1]), x.cumsum(-1)], dim=-1)


def clipped_products(
    log_factors: torch.Tensor, log_start: torch.Tensor | None = None
) -> torch.Tensor:
    """log of a_i = min(1, a_{i-1} f_i) for every i, a_0 = exp(log_start) <= 1 (default 1).

    log_factors [..., L] -> [..., L]. Unrolled, a_i = min(1, min over suffixes of Π f), so with
    S = log_start + cumsum(log f): log a = S - max(0, cummax(S)). Vectorised over the chain
    (block verification's p_i, spec §2; traversal's α, spec §9).
    """
    s = log_factors.cumsum(-1)
    if log_start is not None:
        s = s + log_start.unsqueeze(-1)
    return s - s.cummax(-1).values.clamp_min(0)


def last_passing_level(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """τ = max{i in 1..L : u_i < h_i}, 0 if none. u, h [B, L] -> [B] int64 (spec §2, §3)."""
    levels = torch.arange(1, h.shape[-1] + 1, device=h.device)
    return torch.where(u < h, levels, 0).amax(-1)


def emit(path_tokens: torch.Tensor, tau: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """path_tokens [B, γ], τ [B], last [B] -> tokens [B, γ+1]: path[:τ], last, then -1."""
    B, gamma = path_tokens.shape
    pos = torch.arange(gamma + 1, device=path_tokens.device)[None, :]
    padded = torch.cat([path_tokens, path_tokens.new_full((B, 1), -1)], dim=1)
    out = torch.where(pos < tau[:, None], padded, -1)
    return torch.where(pos == tau[:, None], last[:, None], out)
