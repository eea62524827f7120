"""CUDA graphs for the decode step's forward passes: one captured ``Llama`` forward per static
shape, replayed each step.

Why: on a GPU a small model's decode forward is bound by kernel launches and the Python between
them, not by its weights (docs/gpu.md: a SmolLM2-135M step took 25-70 ms on an H200 whose
bandwidth reads those weights in ~0.1 ms). A graph replays all of a forward's kernels with one
launch and none of its Python.

A forward's shape is static once two things are: its inputs' shapes, and the prefix window its
new tokens attend over. The window is the longest committed length rounded up to a bucket
(`window_bucket`): keys past a request's own length are masked (``Llama._seen_keys``), so a
wider window computes the same rows up to summation order. The batch is padded to a power of
two where the cache has the slots: pad rows run on the slots past the active ones (whatever
those hold), see every new token (a finite softmax), and are cut from the outputs.

Captured: the forwards of a decode step, all at slot 0 over the worker's own cache: the
target's tree pass and the draft's pending-token run (``ForwardGraphs``), and the draft's whole
proposal past its root, every depth's forward, law and draw in one graph (``CallGraphs``, over
``DraftProposer._paths``: a speculative step otherwise launches ~20 small kernels a depth
around each forward). Prefill stays eager (its shapes are the prompts'), and so do forwards over
another cache (a speculation fork's). ``emulate=True`` runs the same static buffers and replays
on any device without capturing (how the CPU tests check the padding, the window and the
output copies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from blockspec.verification.graphs import (
    MAX_GRAPHS,
    GraphCache,
    capture,
    check_batch_first,
    nbytes,
    padded_buffers,
)
from blockspec.workers.llama import KVCache, Llama

# The narrowest window: a few buckets cover a context (256, 512, 1024, ...), and below this the
# masked keys cost less than another graph.
MIN_WINDOW = 256
# Their static inputs and outputs together at most (least recently used dropped first): they sit
# beside the weights and KV caches, and a tree pass's logits at batch 16 alone are ~30 MB.
MAX_BUFFER_BYTES = 2 << 30


def graphs_available(device: str | torch.device) -> bool:
    """Whether decode forwards on `device` can replay from CUDA graphs: a CUDA device on a
    machine with one (the tests' fake device reports cuda without it, and runs eagerly)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def window_bucket(length: int, max_len: int) -> int:
    """The prefix window read for a longest committed `length`: the next power of two, at least
    MIN_WINDOW (read at call time: tests narrow it), at most the cache's max_len."""
    return min(max_len, max(MIN_WINDOW, 1 << max(length - 1, 0).bit_length()))


def prefix_window(cache: KVCache, n: int) -> int:
    """The window a forward of slots [0, n) over `cache` reads (its lengths on the host)."""
    return window_bucket(cache.prefix_length(0, n), cache.max_len)


def batch_bucket(batch: int, slots: int) -> int:
    """The padded batch: the next power of two, or `batch` itself when the cache lacks slots."""
    padded = 1 << (batch - 1).bit_length()
    return padded if padded <= slots else batch


@dataclass
class _Graph:
    replay: Callable[[], None]
    inputs: list[torch.Tensor]  # static, batch-first
    outputs: list | tuple  # what a replay writes (None: no output there)
    spec: pytree.TreeSpec | None = None  # CallGraphs: the call's output structure
    rows: int = 0  # ForwardGraphs: the inputs' rows holding a call's data (the rest: pad rows)

    @property
    def nbytes(self) -> int:
        return nbytes([*self.inputs, *self.outputs])


class OwnCacheForward:
    """What stands in for ``Llama.forward`` as a worker's decode forwards (`ForwardGraphs`,
    workers/compiled.py's `CompiledForward`): the same signature and outputs. A call over the
    worker's own cache at slot 0 runs its own way (`_own`); any other (a speculation fork's
    cache, another slot, no rows) runs eagerly on `model`."""

    model: Llama
    cache: KVCache

    def __call__(
        self,
        tokens: torch.Tensor,  # [n, R, T] int64
        positions: torch.Tensor,  # [n, R, T] int64
        cache: KVCache,
        mask: torch.Tensor,  # [n, R or 1, T or 1, S + T or 1] bool
        suffix: tuple[torch.Tensor, torch.Tensor] | None = None,  # [L, n, R, H_kv, S, D] k, v
        slot0: int = 0,
        features: torch.Tensor | None = None,  # [n, R, T, E]
        head: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        if cache is not self.cache or slot0 != 0 or tokens.shape[0] == 0:
            return self.model(tokens, positions, cache, mask, suffix, slot0, features, head)
        return self._own(tokens, positions, mask, suffix, features, head)

    def _own(self, tokens, positions, mask, suffix, features, head) -> tuple:
        """``model(...)`` over the own cache at slot 0, this class's way."""
        raise NotImplementedError


def _blank(rows: torch.Tensor) -> None:
    """Pad rows of a forward's input: token 0 at position 0, seeing every new token (a finite
    softmax), zero suffix and features."""
    if rows.dtype == torch.bool:
        rows.fill_(True)
    else:
        rows.zero_()


class ForwardGraphs(GraphCache, OwnCacheForward):
    """``model(...)`` over `cache` for decode shapes, replayed from captured CUDA graphs; a call
    with another cache, a slot other than 0 or a failed capture runs eagerly. Same signature
    and outputs as ``Llama.forward``; the outputs are copies (the next replay overwrites the
    graph's own), or with ``copies=False`` views of the graph's own, valid until its next
    replay (a copy is a launch: for a caller done with them by then; another graph's replay
    leaves them be: `capture`). Graphs share one memory pool for their scratch and replay one
    at a time on the current stream."""

    def __init__(
        self,
        model: Llama,
        cache: KVCache,
        emulate: bool = False,
        max_buffer_bytes: int = MAX_BUFFER_BYTES,
        copies: bool = True,
        captured: Callable | None = None,  # what a graph captures: `model`'s forward, or
        # the same compiled (workers/compiled.py); eager calls run `model`
    ):
        super().__init__(MAX_GRAPHS, max_buffer_bytes)
        self.model, self.cache, self.emulate, self.copies = model, cache, emulate, copies
        self.captured = captured or model

    @torch.inference_mode()
    def _own(self, tokens, positions, mask, suffix, features, head) -> tuple:
        n, cache = tokens.shape[0], self.cache
        batch = [tokens, positions, mask]  # every input batch-first
        if suffix is not None:
            batch += [t.transpose(0, 1) for t in suffix]  # [n, L, R, H_kv, S, D] views
        if features is not None:
            batch.append(features)
        bucket = batch_bucket(n, cache.k.shape[1])
        window = prefix_window(cache, n)
        # by bucket: 3 and 4 requests replay bucket 4's one graph
        shapes = tuple((t.shape[1:], t.dtype) for t in batch)
        key = (bucket, window, head, suffix is not None, features is not None, shapes)
        entry = self._entry(
            key, lambda: self._capture(batch, bucket, window, suffix, features, head)
        )
        if entry is None:
            return self.model(tokens, positions, cache, mask, suffix, 0, features, head)
        for static, t in zip(entry.inputs, batch, strict=True):
            static[:n].copy_(t)
            if n < entry.rows:  # a larger batch's rows left there become pad rows again
                _blank(static[n : entry.rows])
        entry.rows = n
        entry.replay()
        self.replays += 1
        logits, k, v, hidden = entry.outputs
        out = (None if logits is None else logits[:n], k[:, :n], v[:, :n], hidden[:n])
        return tuple(t.clone() if self.copies and t is not None else t for t in out)

    def _capture(self, batch, bucket, window, suffix, features, head) -> _Graph:
        n = batch[0].shape[0]
        static = []
        for t in batch:
            buf = t.new_empty((bucket, *t.shape[1:]))
            buf[:n].copy_(t)
            _blank(buf[n:])
            static.append(buf)

        def call():
            tokens, positions, mask = static[:3]
            sfx = (static[3].transpose(0, 1), static[4].transpose(0, 1)) if suffix else None
            feats = static[-1] if features is not None else None
            return self.captured(tokens, positions, self.cache, mask, sfx, 0, feats, head, window)

        if self.emulate:
            outputs = call()

            def recompute() -> None:
                for mine, fresh in zip(outputs, call(), strict=True):
                    if mine is not None:
                        mine.copy_(fresh)

            return _Graph(recompute, static, outputs, rows=n)
        graph, outputs = capture(call, batch[0].device, self._pool)
        self._pool = graph.pool()
        return _Graph(graph.replay, static, outputs, rows=n)


class CallGraphs(GraphCache):
    """``fn(*inputs)`` replayed from a CUDA graph captured per (caller's key, batch bucket,
    input shapes): for a pure call of batch-first tensors whose outputs (a tuple of tensors
    and Nones) are batch-first too, and whose static settings the key names. The batch pads to
    a power of two within the cache's `slots` (the call may run a forward over slots [0,
    bucket)); pad rows hold row 0 of the capturing call, so they compute valid values (a
    token id in range, a position in the cache), and are cut from the outputs, which are
    copies (with ``copies=False``, views valid until the graph's next replay). A failed
    capture runs eagerly with a warning. ``ForwardGraphs`` differs in taking
    ``Llama.forward``'s signature and padding with blank rows."""

    def __init__(
        self,
        slots: int,
        emulate: bool = False,
        max_graphs: int = MAX_GRAPHS,
        max_buffer_bytes: int = MAX_BUFFER_BYTES,
        copies: bool = True,
    ):
        super().__init__(max_graphs, max_buffer_bytes)
        self.slots, self.emulate, self.copies = slots, emulate, copies

    def run(self, key: tuple, fn: Callable, *inputs: torch.Tensor):
        """fn(*inputs) [n, ...] each, from the graph of `key` (the settings fn closes over)."""
        n = inputs[0].shape[0]
        if n == 0:
            return fn(*inputs)
        bucket = batch_bucket(n, self.slots)
        key = (key, bucket, tuple((t.shape[1:], t.dtype, t.device) for t in inputs))
        with torch.inference_mode():  # the buffers are inference tensors, whatever the caller's
            entry = self._entry(key, lambda: self._capture(fn, inputs, bucket))
            if entry is None:
                return fn(*inputs)
            for static, t in zip(entry.inputs, inputs, strict=True):
                static[:n].copy_(t)
            entry.replay()
        self.replays += 1
        # copied in the caller's mode (it may update them in place)
        outputs = [None if o is None else o[:n] for o in entry.outputs]
        if self.copies:
            outputs = [None if o is None else o.clone() for o in outputs]
        return pytree.tree_unflatten(outputs, entry.spec)

    def _capture(self, fn: Callable, inputs: tuple, bucket: int) -> _Graph:
        static = padded_buffers(list(inputs), bucket)

        def call():
            return pytree.tree_flatten(fn(*static))

        if self.emulate:
            outputs, spec = call()

            def recompute() -> None:
                for mine, fresh in zip(outputs, call()[0], strict=True):
                    if mine is not None:
                        mine.copy_(fresh)

            return _Graph(recompute, static, outputs, spec)
        graph, (outputs, spec) = capture(call, inputs[0].device, self._pool)
        self._pool = graph.pool()
        check_batch_first(outputs, bucket)
        return _Graph(graph.replay, static, outputs, spec)
