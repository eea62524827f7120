"""CUDA graphs for verification: one captured graph per shape bucket, replayed each call.

On a GPU a verify call is bound by kernel launches, not by memory traffic: on an H200 at
B = 32, γ = 8, V = 32000, `token` launches 45 kernels that keep the GPU busy 0.14 ms of a
0.78 ms call, and the tree walks launch 100-2,100 (docs/verification_benchmark.md). A graph
replays all of a call's kernels with one launch. Capture needs fixed shapes and no host
reads: on an accelerator every verifier does fixed-shape work and reads nothing back (the
walks mask finished requests instead of dropping them; tests/test_verify_cost.py checks on
CPU that those paths read nothing back and give the CPU paths' tokens).

The batch is padded to a power of two (its bucket), so a few graphs serve every batch size.
Pad rows hold valid rows of an earlier call (or copies of row 0) and their results are
dropped: every verifier treats requests independently. `verify` draws the uniforms before the
call, so a replay computes the same function of the same tensors as the eager call.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from .modification import ResidualRows

log = logging.getLogger(__name__)

# Graphs per cache at most (least recently used dropped): a deployment's warm-up captures a
# graph per method, batch bucket and shape it serves (service/warm_up.py); the byte bound below
# is what holds their memory.
MAX_GRAPHS = 256
# Static inputs per graph at most: above this a call is bound by memory rather than launches,
# and every bucket's buffers would hold that much of the GPU's memory.
MAX_INPUT_BYTES = 512 << 20
# All graphs' input and output buffers together at most (least recently used graphs go first):
# they sit beside the target's weights and KV cache. Intermediates live in one shared pool,
# reused from graph to graph, so they take about one graph's worth.
MAX_BUFFER_BYTES = 2 << 30


def batch_bucket(batch: int) -> int:
    """The padded batch size whose graph serves ``batch`` requests: the next power of two."""
    return 1 << (batch - 1).bit_length()


class GraphCache:
    """Captured graphs by key, the least recently used dropped beyond ``max_graphs`` graphs or
    ``max_buffer_bytes`` of their static buffers (an entry's ``nbytes``); a key whose capture
    failed holds None (its calls run eagerly, after a warning), or with ``strict`` the failure
    raises: while a deployment warms up (service/warm_up.py), a capture that fails is an error
    at start, not a slow path found mid-stream. ``sealed`` (after warm-up) captures nothing
    more: a key not met then runs eagerly (``eager_calls``), since a capture while serving
    stalls the whole batch (a device sync, then the capture). Its graphs share one memory pool
    (``_pool``) for their scratch, each graph's outputs in memory of its own (`capture`), and
    replay one at a time on the current stream. The verifiers' (`VerifyGraphs`) and the decode
    step's (workers/graphs.py) caches."""

    def __init__(self, max_graphs: int, max_buffer_bytes: int):
        self.max_graphs, self.max_buffer_bytes = max_graphs, max_buffer_bytes
        self._graphs: OrderedDict[tuple, object | None] = OrderedDict()  # None: stays eager
        self._pool = None
        self.replays = 0  # calls served by a graph (for tests and benchmarks)
        self.captures = 0  # graphs captured, evicted ones included
        self.strict = False  # a failed capture raises
        self.sealed = False  # no capture: a new key runs eagerly
        self.eager_calls = 0  # calls a sealed cache ran eagerly

    def __len__(self) -> int:
        """Keys seen: graphs held, and shapes whose capture failed."""
        return len(self._graphs)

    @property
    def buffer_bytes(self) -> int:
        """GPU memory held by the graphs' static buffers."""
        return sum(entry.nbytes for entry in self._graphs.values() if entry is not None)

    @property
    def eager_shapes(self) -> int:
        """Keys whose capture failed (they run eagerly; a warning says why)."""
        return sum(entry is None for entry in self._graphs.values())

    def _entry(self, key: tuple, capture: Callable[[], object]):
        """The graph of `key`, captured by `capture()` on first use (None: eager). `capture`
        raises RuntimeError when the call does what a capture refuses (a host read, say)."""
        if key not in self._graphs:
            if self.sealed:
                self.eager_calls += 1
                return None
            try:
                entry = capture()
                self.captures += 1
            except RuntimeError as err:
                if self.strict:
                    raise RuntimeError(f"{type(self).__name__}: capture failed: {err}") from err
                log.warning("%s: %s stays eager: %s", type(self).__name__, key, err)
                entry = None
            self._graphs[key] = entry
            while len(self._graphs) > 1 and (
                len(self._graphs) > self.max_graphs or self.buffer_bytes > self.max_buffer_bytes
            ):
                self._graphs.popitem(last=False)  # the least recently used; never the new one
        self._graphs.move_to_end(key)
        return self._graphs[key]


def fits_graph(tensors: list[torch.Tensor]) -> bool:
    """Whether a call of these batch-first tensors replays from a graph: a batch, and static
    buffers of its bucket within MAX_INPUT_BYTES (above, the call is bound by memory, not
    launches)."""
    batch = tensors[0].shape[0]
    if batch == 0:
        return False
    per_row = sum(t[0].numel() * t.element_size() for t in tensors)
    return batch_bucket(batch) * per_row <= MAX_INPUT_BYTES


def padded_buffers(tensors: list[torch.Tensor], bucket: int) -> list[torch.Tensor]:
    """A graph's static buffers for batch-first tensors: each [bucket, ...], the rows past the
    batch copies of row 0 (valid inputs: a pad row computes nothing undefined)."""
    static = []
    for t in tensors:
        buf = t.new_empty((bucket, *t.shape[1:]))
        buf[: t.shape[0]].copy_(t)
        buf[t.shape[0] :].copy_(t[:1].expand(bucket - t.shape[0], *t.shape[1:]))
        static.append(buf)
    return static


def nbytes(tensors) -> int:
    """Bytes held by the tensors (None entries skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # static buffers, batch-first, [bucket, ...]
    outputs: list[torch.Tensor]  # what the replay writes, batch-first
    spec: pytree.TreeSpec  # the verifier's output structure

    @property
    def nbytes(self) -> int:  # the pool holds the intermediates, about one graph's worth
        return nbytes([*self.inputs, *self.outputs])


class VerifyGraphs(GraphCache):
    """Captured verifier calls (or any pure call whose inputs and outputs are batch-first
    tensors: the draft tree's build, workers/tree.py) by (method, batch bucket, shapes,
    dtypes, device): a GraphCache of their input buffers. One per process that verifies on
    a GPU. Its outputs are copies, or with ``copies=False`` views of the graph's own, valid
    until its next replay (a copy is a launch: for a caller done with them by then)."""

    def __init__(
        self,
        max_graphs: int = MAX_GRAPHS,
        max_buffer_bytes: int = MAX_BUFFER_BYTES,
        copies: bool = True,
    ):
        super().__init__(max_graphs, max_buffer_bytes)
        self.copies = copies

    def run(self, method: str, fn: Callable, *inputs):
        """``fn(*inputs)``, by replaying the bucket's graph (captured on first use) on CUDA,
        unless the bucket's inputs are so large that the call is bound by memory, not launches.

        inputs: batch-first tensors and ResidualRows; a verifier's are draft_tokens [B, K, γ],
        draft_probs [B, K, γ, V], target_probs [B, K, γ+1, V], uniforms [B, n][, modified
        ResidualRows [B, K, γ]], or with the carried records' [B, R] tensors after the
        uniforms (`verify`: the records applied and advanced in the same graph)."""
        tensors = _flatten(inputs)
        batch = tensors[0].shape[0]
        if tensors[0].device.type != "cuda" or not fits_graph(tensors):
            return fn(*inputs)
        # host-known branches of fn
        unmodified = tuple(x.unmodified for x in inputs if isinstance(x, ResidualRows))
        shapes = tuple((t.shape[1:], t.dtype) for t in tensors)
        key = (method, batch_bucket(batch), unmodified, shapes, tensors[0].device)
        # The buffers are inference tensors whatever the caller's mode (the target's actors
        # verify under inference_mode, an engine may not): written only in that mode.
        with torch.inference_mode():
            entry = self._entry(key, lambda: self._capture(method, fn, inputs, tensors))
        if entry is None:
            return fn(*inputs)
        with torch.inference_mode():
            for static, t in zip(entry.inputs, tensors, strict=True):
                static[:batch].copy_(t)
            entry.graph.replay()
        self.replays += 1
        # The next replay overwrites the outputs: hand out copies of the real rows (made in
        # the caller's mode, so it may update them in place).
        outputs = [o[:batch].clone() if self.copies else o[:batch] for o in entry.outputs]
        return pytree.tree_unflatten(outputs, entry.spec)

    def _capture(self, method, fn, inputs, tensors) -> _Graph:
        bucket = batch_bucket(tensors[0].shape[0])
        static = padded_buffers(tensors, bucket)

        def call():
            return fn(*_unflatten(inputs, static))

        graph, out = capture(call, tensors[0].device, self._pool)
        self._pool = graph.pool()
        outputs, spec = pytree.tree_flatten(out)
        check_batch_first(outputs, bucket)
        return _Graph(graph, static, outputs, spec)


def capture(call: Callable, device: torch.device, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of `call()` on `device` (its scratch memory from `pool`, when given) and the
    outputs its replays write. `call` runs once before, on a side stream: first calls
    initialise lazily (kernel loads, handles), which a capture may not. Raises RuntimeError
    when `call` does what a capture refuses (a host read, say). Also the decode forwards'
    (workers/graphs.py).

    The outputs live outside the pool, in memory of their own that the graph copies into as
    its last kernels: graphs sharing a pool reuse each other's scratch, so an output left in
    the pool could sit where an earlier-captured graph writes at every replay, and a caller
    holding it (a view, ``copies=False``) across that replay would read garbage. Scratch is
    only read within its own replay, so shared, it is safe in any replay order, eviction and
    recapture included (tests/test_fake_graphs.py)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        warm = call()
    torch.cuda.current_stream(device).wait_stream(side)
    own = pytree.tree_map(lambda t: torch.empty_like(t) if isinstance(t, torch.Tensor) else t, warm)
    del warm
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA work (a worker's) does not break the capture
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        for mine, scratch in zip(_leaves(own), _leaves(call()), strict=True):
            mine.copy_(scratch)
    return graph, own


def _leaves(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def check_batch_first(outputs: list, bucket: int) -> None:
    """Raises RuntimeError (a failed capture) unless every output has the bucket's rows: the
    real ones are cut from them."""
    if any(o is not None and o.shape[:1] != (bucket,) for o in outputs):
        raise RuntimeError("an output is not batch-first")


def _flatten(inputs: tuple) -> list[torch.Tensor]:
    """The call's tensors, batch-first: modified rows as their two [B, K, γ] scalars."""
    tensors = []
    for x in inputs:
        tensors += [x.t, x.z] if isinstance(x, ResidualRows) else [x]
    return tensors


def _unflatten(inputs: tuple, tensors: list[torch.Tensor]) -> list:
    """The call's arguments over `tensors` (a graph's buffers), as `inputs` were structured."""
    given, args = iter(tensors), []
    for x in inputs:
        if isinstance(x, ResidualRows):
            args.append(ResidualRows(next(given), next(given), x.unmodified))
        else:
            args.append(next(given))
    return args
