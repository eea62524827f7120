"""Processed sampling distributions: temperature, top-k, top-p (spec §0.1).

Hugging Face's semantics and order (``generate``'s warpers): temperature, then top-k (every
token whose logit ties the k-th largest stays), then top-p over the top-k survivors
*renormalised* (a token stays while the mass of the tokens above it is < top_p; the most likely
always stays; which of several tied logits at the boundary stay is decided by the same
``torch.sort`` call HF makes). Temperature 0 is greedy: one-hot on the argmax, ties to the
lowest id.

Both the draft and the target rows handed to a verifier go through :func:`process`, each with
the request's settings, and the draft samples from exactly the row it reports: otherwise the
verifier's q-ratios are wrong and the output is not lossless.

:func:`sample_from_weights` (inverse CDF with uniforms the caller drew) is the one sampler of
the project: the draft's :func:`sample_drafts`, the plain rows' :func:`sample` and the verifiers
use it (verification/tensors.py).

The draft's uniforms are *counter-based* (:func:`draft_uniforms`): a hash of (the request's draft
key, the step's root position, path, depth), not a stream consumed in order. A proposal for a
prefix is then the same bits whenever and wherever it is made (in the step that needs it, or
ahead of it by the speculation cache, workers/speculation.py), and the draft needs no generator
state. The root position grows strictly from step to step (each step emits a token), so no key
repeats across steps: keying by the drafted token's own position instead would hand a redraft
the uniforms of the rejected draft at that position, which the verification outcome depended on
(a lossy mutant, tests/test_speculation.py). The verifier's uniforms, and a plain request's, are
counter-based the same way, under the request's other key (:func:`verify_key`, keyed by the
root position and the number's index: verification.CounterDraws): no generator state is kept,
shipped to the target's rank 0, or restored after a failed step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from blockspec.verification.tensors import (
    counter_uniforms,
    keyed_uniforms,
    sample_from_weights,
    splitmix64,
)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (one-hot on the argmax, ties to the lowest id)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        # An invariant, not a request check: requests are checked, with messages for the
        # client, by service/requests.py (NaN fails the comparisons too).
        if not (self.temperature >= 0 and self.top_k >= 0 and 0 < self.top_p <= 1):
            raise ValueError(f"sampling parameters out of range: {self}")


@dataclass(frozen=True)
class Law:
    """The requests' processing settings (one row each) as device tensors: what
    :func:`apply_law` reads. A step no request asks for is None and does not run, decided on
    the host from the params (no device read): a whole-vocabulary temporary costs a pass and,
    above glibc's mmap threshold, fresh pages, so the common batch (T = 1, no top-k/top-p,
    nobody greedy) is one softmax, ~11x cheaper than running every step on every row
    ([8, 5, 49152]: 38.8 -> 3.5 ms). Skipped steps are identities (x / 1.0 == x), so the rows
    are the same bits either way. Which steps run (`steps`) is host data: a CUDA graph of a
    law is one per `steps` (the draft's proposal, workers/draft.py)."""

    divisor: torch.Tensor | None  # [n] float32: each temperature (1 for a greedy row)
    top_k: torch.Tensor | None  # [n] int64 in [1, V]
    top_p: torch.Tensor | None  # [n] float64
    greedy: torch.Tensor | None  # [n] bool: one-hot on the argmax
    # topk's width: the largest top-k rounded up to a power of two (at most V), so that a graph
    # of the law (keyed by `steps`) serves every top-k up to it; a row's own k picks its k-th
    # value from the sorted top, the same whatever the width
    max_k: int = 0

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The steps' tensors, each [n, ...]."""
        return [t for t in (self.divisor, self.top_k, self.top_p, self.greedy) if t is not None]

    @property
    def steps(self) -> tuple:
        """Which steps run, and topk's width: everything but the tensors' values."""
        present = (self.divisor, self.top_k, self.top_p, self.greedy)
        return (*(t is not None for t in present), self.max_k)

    def on(self, tensors: list[torch.Tensor]) -> Law:
        """The same steps over other tensors (in `tensors`' order: a graph's static inputs)."""
        given = iter(tensors)
        present = (self.divisor, self.top_k, self.top_p, self.greedy)
        return Law(*(None if t is None else next(given) for t in present), max_k=self.max_k)


def law_of(params: list[SamplingParams], vocab: int, device: torch.device) -> Law:
    """The Law of `params` (one per row) over `vocab` tokens, its tensors on `device` (copied
    without waiting for it)."""

    def on_dev(values: list, dtype=None) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    temps = [p.temperature for p in params]
    divisor = None
    if any(t not in (0.0, 1.0) for t in temps):  # greedy rows keep their logits: argmax only
        divisor = on_dev([t if t > 0 else 1.0 for t in temps], torch.float32)
    ks = [min(p.top_k or vocab, vocab) for p in params]
    top_k = on_dev(ks) if min(ks) < vocab else None
    top_p = None
    if min(p.top_p for p in params) < 1:
        top_p = on_dev([p.top_p for p in params], torch.float64)
    greedy = on_dev([t == 0 for t in temps]) if 0.0 in temps else None
    max_k = min(vocab, 1 << (max(ks) - 1).bit_length()) if top_k is not None else 0
    return Law(divisor, top_k, top_p, greedy, max_k)


def process(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [n, ..., V] (one SamplingParams per leading row) -> probabilities, same shape."""
    return apply_law(logits, law_of(params, logits.shape[-1], logits.device))


def apply_law(logits: torch.Tensor, law: Law) -> torch.Tensor:
    """logits [n, ..., V] (one row of `law` per leading row) -> probabilities, same shape: with
    no host read and fixed shapes (a CUDA graph can hold it)."""
    n, vocab = logits.shape[0], logits.shape[-1]
    scaled = logits.float().reshape(n, -1, vocab)
    if law.divisor is not None:
        scaled = scaled / law.divisor[:, None, None]
    if law.top_k is not None:
        largest = scaled.topk(law.max_k, dim=-1).values  # [n, R, max k]
        kth = largest.gather(-1, (law.top_k[:, None, None] - 1).expand(*largest.shape[:2], 1))
        scaled = scaled.masked_fill(scaled < kth, -torch.inf)  # every tie with the k-th stays
    if law.top_p is not None:
        # HF's computation exactly (the same sort call, the same cumulative sum): a kept set can
        # flip on the last float bit, or on the order the sort gives tied logits.
        ascending, order = scaled.sort(dim=-1)
        cumulative = ascending.softmax(-1).cumsum(-1)
        drop = cumulative <= (1 - law.top_p[:, None, None]).float()  # 1 - p in double as HF
        drop[..., -1] = False  # the most likely token always stays
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -torch.inf)
    probs = scaled.softmax(-1)
    if law.greedy is not None:  # one-hot on the argmax, ties to the lowest id
        top = scaled.argmax(-1, keepdim=True)  # [n, R, 1]
        one_hot = torch.zeros_like(probs).scatter_(-1, top, 1.0)
        probs = torch.where(law.greedy[:, None, None], one_hot, probs)
    return probs.reshape(logits.shape)


# Salts that part a request's seed into its two streams: the draft's and the verifier's.
DRAFT_SALT, VERIFY_SALT = 0x5EED_D2AF7, 0x5EED_7E41F


def stream_key(seed: int, salt: int) -> int:
    """A request's key for one of its counter-based streams, in [0, 2^63) (an int64 tensor
    holds it), from its seed (any in [0, 2^64): the API's range)."""
    state = np.array([(seed ^ salt) & ((1 << 64) - 1)], dtype=np.uint64)
    return int(splitmix64(state)[0] >> np.uint64(1))


def draft_key(seed: int) -> int:
    """A request's draft key (what its draft uniforms hash)."""
    return stream_key(seed, DRAFT_SALT)


def verify_key(seed: int) -> int:
    """A request's verify key: what its verifier's and its plain rows' uniforms hash, with the
    step's root position as the counter (verification.common.CounterDraws)."""
    return stream_key(seed, VERIFY_SALT)


def draft_uniforms(
    draws: torch.Tensor,  # [n, 2] int64: (the request's draft key, the step's root position)
    k: int,
    gamma: int,
) -> torch.Tensor:
    """Uniforms [n, K, γ] float64 in [0, 1) for drafting K paths of γ tokens: u[i, path, depth]
    = hash(key_i, root_i, path, depth), independent of everything else in the batch."""
    key, root = draws[:, 0, None, None], draws[:, 1, None, None]
    dev = draws.device
    path = torch.arange(k, dtype=torch.int64, device=dev)[None, :, None]
    depth = torch.arange(gamma, dtype=torch.int64, device=dev)[None, None, :]
    return counter_uniforms(key, root, (path << 32) | depth)


def sample_drafts(
    probs: torch.Tensor,  # [n, K, V]: the rows of one depth
    u: torch.Tensor,  # [n, K] float64 on probs' device: draft_uniforms at that depth
) -> torch.Tensor:
    """One token per row [n, K], by inverse CDF with the counter-based uniforms."""
    n, k, vocab = probs.shape
    return sample_from_weights(probs.reshape(n * k, vocab), u.reshape(-1)).view(n, k)


def downweight_top(
    probs: torch.Tensor,  # [..., V]: processed rows
    count: int,
    factor: float,
) -> torch.Tensor:
    """Saguaro sampling (SSD, arXiv 2603.03251): each row's `count` likeliest tokens scaled by
    `factor` (< 1), renormalised: [..., V]. A draft that samples from these rows, and reports
    them, stays lossless (verification reads the rows it drew from); after a rejection the
    residual (p - q)+ then puts its mass where the draft ranks its top tokens, the outcomes a
    speculation cache prepares (workers/speculation.py). A one-hot row stays one-hot."""
    top = probs.topk(min(count, probs.shape[-1]), dim=-1).indices
    scaled = probs.scatter(-1, top, probs.gather(-1, top) * factor)
    return scaled / scaled.sum(-1, keepdim=True)


def sample(
    probs: torch.Tensor,  # [n, R, V]: R rows per request
    draws: torch.Tensor,  # [n, 2] int64 on the host: (verify key, the step's root position)
) -> torch.Tensor:
    """One token per row [n, R]: row r of request i with u = hash(key_i, root_i, r), the same
    bits as that request's verifier would draw first, which its step does not also run."""
    n, r, vocab = probs.shape
    u = keyed_uniforms(draws, r).to(probs.device, non_blocking=True)  # no wait for the device
    return sample_from_weights(probs.reshape(n * r, vocab), u.reshape(-1)).view(n, r)
