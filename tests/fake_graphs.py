"""CUDA graphs on the fake device (``FakeCuda(graphs=True)``, tests/fake_device.py), with
CUDA's semantics, so that the graph path's memory and capture bugs fail on a CPU.

What a real capture does, and so this one:

- **A replay re-runs the captured kernels on the same memory.** Capture records every device
  op (its function and its arguments' storages); ``replay()`` runs them again, writing each
  output into the storage the capture gave it. None of the captured call's Python runs again:
  a branch taken at capture is taken at every replay, and a 0-dim host tensor (or a Python
  number) is baked in with its value at capture.
- **Memory comes from the graph's pool, and is reused.** Every tensor a capture makes lives in
  a block of its pool (a graph's own, or one shared through ``pool=graph.pool()``), and a
  block no live tensor holds is handed to the next allocation of a capture into that pool, as
  the caching allocator does: a later graph's scratch, or its outputs, may sit in memory an
  earlier graph still writes at every replay. A tensor held across another graph's replay
  keeps its values only if it lives outside the pools (or nothing else writes its block).
- **What a capture refuses fails.** A host read (``item``, ``tolist``, a copy to the host,
  ``nonzero``, a boolean-mask index), a copy from the host (blocking or not: pageable memory
  cannot be captured), a host index tensor (copied to the device before the gather), a CPU
  generator: ``RuntimeError: operation not permitted when stream is capturing``, which the
  graph caches catch as a failed capture.

The harness counts captures (``FakeCuda.captures``) and a replay as one launch (``graph``).
Streams are one (a side stream is the current one), which is how the code under test uses them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

CAPTURE_ERROR = "operation not permitted when stream is capturing (fake device: {what})"
_ALIGN = 512  # the caching allocator's rounding


class _Block:
    """Pool memory for one allocation: free once no wrapper tensor over it lives."""

    def __init__(self, nbytes: int):
        self.storage = torch.UntypedStorage(nbytes)
        self.holders: list[weakref.ref] = []
        self.reserved = False  # handed out, not yet wrapped

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes()

    @property
    def free(self) -> bool:
        return not self.reserved and all(h() is None for h in self.holders)


class Pool:
    """A graph's memory pool (what ``CUDAGraph.pool()`` hands out): blocks, a free one reused
    best-fit (the newest of equal sizes)."""

    def __init__(self) -> None:
        self.blocks: list[_Block] = []

    def allocate(self, nbytes: int) -> _Block:
        nbytes = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        fits = [(b.nbytes, -i, b) for i, b in enumerate(self.blocks) if b.nbytes >= nbytes]
        free = [f for f in fits if f[2].free]
        if free:
            block = min(free, key=lambda f: f[:2])[2]
        else:
            block = _Block(nbytes)
            self.blocks.append(block)
            _BLOCKS[block.storage.data_ptr()] = block
        block.holders, block.reserved = [], True
        return block


# Every pool's blocks by address: a wrapper made over one holds it (`hold`).
_BLOCKS: weakref.WeakValueDictionary[int, _Block] = weakref.WeakValueDictionary()


def hold(elem: torch.Tensor, wrapper: torch.Tensor) -> None:
    """A fake-device tensor `wrapper` over `elem` now lives: its pool block, if any, is taken."""
    if not _BLOCKS or elem.numel() == 0:
        return
    block = _BLOCKS.get(elem.untyped_storage().data_ptr())
    if block is not None:
        block.holders.append(weakref.ref(wrapper))
        block.reserved = False


class FakeGraph:
    """``torch.cuda.CUDAGraph`` on the fake device: the ops its capture recorded."""

    def __init__(self, *args, **kwargs) -> None:
        self.steps: list[Callable[[], None]] = []
        self._pool: Pool | None = None
        self.captured = False

    def pool(self) -> Pool:
        return self._pool

    def replay(self) -> None:
        import fake_device

        if not self.captured:
            raise RuntimeError("replay of a graph that was not captured (fake device)")
        harness = fake_device._ACTIVE[-1] if fake_device._ACTIVE else None
        if harness is not None:
            fake_device._count_kernel("graph")
            harness._graphed = True
        try:
            for step in self.steps:
                step()
        finally:
            if harness is not None:
                harness._graphed = False


CUDAGraph = FakeGraph  # torch.cuda's name
_CAPTURING: list[FakeGraph] = []  # the graph being captured, if any


def capturing() -> bool:
    return bool(_CAPTURING)


def refuse(what: str) -> None:
    """Fails as CUDA does when `what` (a host read, a copy from the host) happens in capture."""
    if _CAPTURING:
        raise RuntimeError(CAPTURE_ERROR.format(what=what))


class graph:  # torch.cuda.graph's stand-in, by its name
    """``torch.cuda.graph(g, pool=..., ...)``: the ops run inside are recorded into g."""

    def __init__(self, cuda_graph: FakeGraph, pool: Pool | None = None, stream=None, **kwargs):
        self.cuda_graph, self.pool_ = cuda_graph, pool

    def __enter__(self) -> None:
        import fake_device

        if _CAPTURING:
            raise RuntimeError("a capture inside a capture (fake device)")
        harness = fake_device._ACTIVE[-1]
        harness.captures += 1
        harness._graphed = True  # a capture launches nothing
        self.cuda_graph._pool = self.pool_ if self.pool_ is not None else Pool()
        _CAPTURING.append(self.cuda_graph)

    def __exit__(self, *exc) -> None:
        import fake_device

        _CAPTURING.pop()
        fake_device._ACTIVE[-1]._graphed = False
        self.cuda_graph.captured = exc[0] is None


class Stream:
    """``torch.cuda.Stream``: one stream, so waits between streams are nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other: Stream) -> None:
        pass


def current_stream(device=None) -> Stream:
    return Stream()


def stream(s: Stream):
    return contextlib.nullcontext()


def record(fn: Callable, args: tuple, kwargs: dict, out, mutates: bool, fills: bool = True):
    """In capture: `out` = fn(*args, **kwargs) (CPU tensors) with its fresh tensors moved into
    the pool, and the op recorded for replays (`mutates`: it writes an argument; not `fills`:
    an allocation, nothing to replay); outside, `out` unchanged."""
    if not _CAPTURING:
        return out
    graph_ = _CAPTURING[-1]
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    held = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    flat, spec = tree_flatten(out)
    fresh = []
    for i, t in enumerate(flat):
        if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in held:
            flat[i] = _into_pool(graph_._pool, t, copy=fills)
            fresh.append((i, flat[i]))
    if fills and (fresh or mutates):
        args, kwargs = tree_map(_baked, (args, kwargs))
        graph_.steps.append(_replay_step(fn, args, kwargs, fresh))
    return tree_unflatten(flat, spec)


def _into_pool(pool: Pool, t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """t's values in a pool block, in t's layout (its storage's extent)."""
    nbytes = t.untyped_storage().nbytes()
    block = pool.allocate(nbytes)
    dst = torch.empty(0, dtype=t.dtype).set_(block.storage, t.storage_offset(), t.shape, t.stride())
    if copy:
        dst.copy_(t)
    return dst


def _baked(x):
    """A 0-dim host tensor as its value at capture (a kernel's argument, not memory)."""
    if isinstance(x, torch.Tensor) and x.dim() == 0 and x.device.type == "cpu":
        return x.clone()
    return x


def _replay_step(fn, args, kwargs, fresh) -> Callable[[], None]:
    def step() -> None:
        flat = tree_flatten(fn(*args, **kwargs))[0]
        for i, dst in fresh:
            dst.copy_(flat[i])

    return step
