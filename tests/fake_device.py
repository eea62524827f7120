"""A fake CUDA device on a CPU-only machine: device bugs and host waits show up in CI.

``FakeCuda`` (a context manager) makes every tensor that code puts on ``cuda`` a
``FakeCudaTensor``: a tensor that reports ``device == cuda:0`` (``is_cuda``, ``device.type``)
and holds a real CPU tensor that every operation runs on. What a real GPU would refuse is
refused the same way:

- an operation that mixes a fake-CUDA tensor with a CPU tensor of one or more dimensions raises
  CUDA's ``RuntimeError: Expected all tensors to be on the same device`` (0-dim CPU tensors
  mix freely, as CUDA allows; so do CPU index tensors of advanced indexing, and copies);
- a CPU ``torch.Generator`` cannot draw on the device; ``.numpy()`` of a device tensor fails.

Every read of device data on the host is counted as a *host sync* (``FakeCuda.syncs``, and
``sites``: where in service/, workers/ and verification/ each came from): ``.item()``,
``int()``/``bool()``/``float()``, ``.tolist()``, ``.cpu()`` and other device-to-host copies,
the ops whose output size depends on device data (``nonzero``, ``masked_select``, indexing
with a device boolean mask), and blocking host-to-device copies (``.to(device)`` without
``non_blocking=True``, ``torch.tensor(data, device=...)``, a slice assigned from the host):
CUDA synchronizes the stream before such a copy returns, so the host waits for all queued work
as for a read. Every copy from the host is also counted in ``h2d``.

Every device kernel an op would launch eagerly is counted too (``FakeCuda.kernels`` by op,
``kernel_sites`` by function): what a GPU pays ~5-10 µs of launch and Python for, and a CUDA
graph replays for one launch. Views, ``empty`` and host reads launch nothing; a replay of a
decode forward's graph (workers/graphs.py, emulated) or of a verifier's counts as one launch,
``graph``, whatever it runs, and so does its capture.

How: ``FakeCudaTensor`` is a wrapper subclass (``_make_wrapper_subclass`` on the meta device
with ``dispatch_device=True``: its device is answered by ``__torch_dispatch__``, as
FakeTensor does on CPU-only builds) whose ``__torch_dispatch__`` unwraps, checks devices, runs
the op on the CPU tensors and wraps the outputs. A ``TorchFunctionMode`` turns factories and
``.to()``/``.cuda()`` with a CUDA device into wrapped tensors, and takes the calls that a
CPU-only build cannot dispatch for a CUDA-looking tensor (indexing sets a CUDA device guard)
or that read data back (``tolist``, ``item``, ``__int__``...). It works under
``torch.inference_mode``, which the engine and workers use.

The code under test then takes its accelerator paths (``host_reads_are_free`` is False, the
verifiers do their fixed-shape work, ``cumsum64`` scans in chunks), except two that need a
real GPU and are switched off while the context is active: the verifiers' Triton kernels
(``verification.kernels.available`` returns False, so ``choose_backend`` picks the
``torch-device`` backend, the torch ops of an accelerator) and CUDA graphs
(``VerifyGraphs.run`` calls the verifier eagerly), unless ``FakeCuda(graphs=True)``: then
graphs capture and replay on the fake device with CUDA's semantics (tests/fake_graphs.py).
"""

from __future__ import annotations

import copy
import sys
from collections import Counter
from pathlib import Path

import fake_graphs
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE_CUDA = torch.device("cuda", 0)
_CPU = torch.device("cpu")
_MASKS = (torch.bool, torch.uint8)
_ROOT = Path(__file__).resolve().parents[1]
_SOURCES = tuple(str(_ROOT / d) for d in ("service", "workers", "verification"))
_ACTIVE: list[FakeCuda] = []  # the innermost active harness (its counters)

_SAME_DEVICE_ERROR = (
    "Expected all tensors to be on the same device, but found at least two devices, "
    "cuda:0 and cpu! (fake device: {op})"
)
_INDEX_ERROR = "indices should be either on cpu or on the same device as the indexed tensor (cpu)"
_GENERATOR_ERROR = "Expected a 'cuda' device type for generator but found 'cpu' (fake device)"
_NUMPY_ERROR = (
    "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
    "host memory first."
)

aten = torch.ops.aten
# Ops that copy between devices (legal across them).
_COPIES = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default}
# Advanced indexing: the indices (argument 1) may stay on the CPU.
_INDEXING = {
    aten.index.Tensor,
    aten.index_put_.default,
    aten.index_put.default,
    aten._index_put_impl_.default,
}
# Factories that copy host data to the device, blocking (torch.tensor(data, device=...)).
_FROM_HOST_DATA = (torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor)
_SIZE_FROM_DATA = {aten.nonzero.default, aten.masked_select.default}  # a host wait on a GPU
_HOST_READS = (
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
)


def is_fake(t) -> bool:
    return isinstance(t, FakeCudaTensor)


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # a bare index names a CUDA device
        return True
    return torch.device(device).type in ("cuda", "meta")  # meta: a wrapper's own


def _unwrap(t):
    return t.elem if isinstance(t, FakeCudaTensor) else t


def _wrap(t):
    if isinstance(t, torch.Tensor) and not isinstance(t, FakeCudaTensor):
        return FakeCudaTensor(t)
    return t


def _count(kind: str) -> None:
    if not _ACTIVE:
        return
    fake_graphs.refuse(kind)
    harness = _ACTIVE[-1]
    harness.syncs[kind] += 1
    harness.sites[_site()] += 1


def _count_h2d(blocking: bool) -> None:
    """A copy from the host. A blocking one (PyTorch's default) synchronizes the stream before it
    returns: the host waits for all queued device work, a host sync like a read."""
    fake_graphs.refuse("a copy from the host")
    if _ACTIVE:
        _ACTIVE[-1].h2d += 1
        if blocking:
            _count("h2d wait")


def _argument(func, args, kwargs, name: str, default):
    """An aten op's argument by name, given by keyword or by position."""
    if name in kwargs:
        return kwargs[name]
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == name and i < len(args):
            return args[i]
    return default


def _site(line: bool = True) -> str:
    """The innermost frame in service/, workers/ or verification/ (where the read was written):
    its file, line and function (without `line`: its file and function)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_SOURCES):
            where = f":{frame.f_lineno}" if line else ""
            return f"{Path(name).relative_to(_ROOT)}{where} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "elsewhere"


# Ops that launch no kernel on a GPU beside views (``OpOverload.is_view``): an allocation, a read.
_NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten._local_scalar_dense.default,
    aten.lift_fresh.default,
}


# Factories that only allocate (no kernel fills them).
_ALLOCATIONS = (torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty)


def _count_kernel(name: str) -> None:
    """One kernel launched eagerly on the device (none inside a graph's replay or capture)."""
    if _ACTIVE and not _ACTIVE[-1]._graphed:
        harness = _ACTIVE[-1]
        harness.kernels[name] += 1
        harness.kernel_sites[_site(line=False)] += 1


def _as_graph(fn):
    """fn, run as a graph: one launch, whatever kernels it runs (counted by the harness active
    when it runs: a graph captured under one harness may replay under another)."""

    def launch(*args, **kwargs):
        harness = _ACTIVE[-1] if _ACTIVE else None
        if harness is None or harness._graphed:
            return fn(*args, **kwargs)
        _count_kernel("graph")
        harness._graphed = True
        try:
            return fn(*args, **kwargs)
        finally:
            harness._graphed = False

    return launch


def _capture_as_graph(capture):
    """A graphs class's emulated `_capture`, counted as a graph's: once, and then its replays."""

    def counted(graphs, *args):
        entry = _as_graph(capture)(graphs, *args)  # or raises: a failed capture
        entry.replay = _as_graph(entry.replay)
        return entry

    return counted


def _check_generators(flat: list, on_device: bool) -> None:
    for g in flat:
        if isinstance(g, torch.Generator) and on_device and g.device.type != "cuda":
            raise RuntimeError(_GENERATOR_ERROR)


def _mixes(tensors: list[torch.Tensor]) -> bool:
    """A fake-CUDA tensor next to a CPU tensor that CUDA would not take (one of 1+ dims)."""
    return any(is_fake(t) for t in tensors) and any(not is_fake(t) and t.dim() > 0 for t in tensors)


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor (``elem``) that reports device cuda:0. See the module's docstring."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        if type(elem) is not torch.Tensor or elem.device.type != "cpu":
            raise TypeError(f"FakeCudaTensor wraps a plain CPU tensor, got {type(elem)}")
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device="meta",
            dispatch_device=True,
            requires_grad=False,
        )
        r.elem = elem
        fake_graphs.hold(elem, r)
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"FakeCudaTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _target_device(func, args, kwargs):
    """The device an op puts its output on when it names one (factories, copies), else None."""
    device = kwargs.get("device")
    if device is None and func.overloadpacket is aten.to:
        device = next((a for a in args[1:] if isinstance(a, torch.device | str)), None)
    return device


def _dispatch(func, args, kwargs):
    """One aten op: check devices, count host syncs, run on the CPU tensors, wrap outputs."""
    if func is torch.ops.prim.device.default:
        return FAKE_CUDA if is_fake(args[0]) else func(*args, **kwargs)
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    fake_in = any(is_fake(t) for t in tensors)
    device = _target_device(func, args, kwargs)
    to_device = _is_cuda(device)
    if not fake_in and not to_device:
        return func(*args, **kwargs)
    to_host = device is not None and not to_device
    copies = func in _COPIES or func.overloadpacket is aten.to
    _check_generators(flat, True)
    if func in _INDEXING:
        indices = [i for i in args[1] if i is not None]
        if not is_fake(args[0]) and any(is_fake(i) for i in indices):
            raise IndexError(_INDEX_ERROR)
        if is_fake(args[0]) and any(is_fake(i) and i.dtype in _MASKS for i in indices):
            _count("mask index")
        if any(not is_fake(i) and i.dim() > 0 for i in indices):
            fake_graphs.refuse("a host index tensor")
        checked = [args[0], *args[2:3]]  # self and values: one device (values may be 0-dim)
        if _mixes([t for t in checked if isinstance(t, torch.Tensor)]):
            raise RuntimeError(_SAME_DEVICE_ERROR.format(op=func))
    elif not copies and _mixes(tensors):
        raise RuntimeError(_SAME_DEVICE_ERROR.format(op=func))
    if func is aten._local_scalar_dense.default:
        _count("item")
    elif func in _SIZE_FROM_DATA:
        _count(func.overloadpacket.__name__)
    elif copies and func is not aten.copy_.default:
        if is_fake(args[0]) and to_host:
            _count("to host")
        elif not is_fake(args[0]) and to_device:
            _count_h2d(not _argument(func, args, kwargs, "non_blocking", False))
    elif func is aten.copy_.default and is_fake(args[0]) != is_fake(args[1]):
        if is_fake(args[1]):
            _count("to host")
        elif args[1].dim() > 0:
            _count_h2d(not _argument(func, args, kwargs, "non_blocking", False))

    if not func.is_view and func not in _NO_KERNEL and (to_device or not to_host):
        _count_kernel(func.overloadpacket.__name__)
    u_args, u_kwargs = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
    if to_device:
        if "device" in u_kwargs:
            u_kwargs["device"] = torch.device("cpu")
        else:
            u_args = tuple(_CPU if a is device else a for a in u_args)
    out = func(*u_args, **u_kwargs)
    out = fake_graphs.record(
        func, u_args, u_kwargs, out, func._schema.is_mutable, fills=func not in _NO_KERNEL
    )
    wrap = to_device or not to_host
    originals = {id(_unwrap(a)): a for a in tensors}

    def back(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) in originals:  # returned its input (in place, or a no-op .to())
            orig = originals[id(t)]
            if copies and is_fake(orig) != wrap:  # .to() across devices: a new tensor
                return _wrap(t.clone()) if wrap else t.clone()
            if is_fake(orig) and (orig.shape != t.shape or orig.stride() != t.stride()):
                raise NotImplementedError(f"fake device: {func} changed a tensor's shape")
            return orig
        return _wrap(t) if wrap else t

    return tree_map(back, out)


class _FakeDispatchMode(TorchDispatchMode):
    """Sees every aten op, factories included (a composite op may make a tensor on its input's
    device, e.g. a wrapped scalar; a CPU-only build has no CUDA kernel to make it)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


class FakeCudaMode(TorchFunctionMode):
    """Turns CUDA placements into FakeCudaTensors; takes the calls a wrapper cannot dispatch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            return self._to(func, args, kwargs)
        if func is torch.Tensor.__getitem__:
            return self._getitem(*args)
        if func is torch.Tensor.__setitem__:
            return self._setitem(*args)
        if func in _HOST_READS and is_fake(args[0]):
            _count(func.__name__.strip("_"))
            return func(args[0].elem, *args[1:], **kwargs)
        if func is torch.Tensor.numpy and is_fake(args[0]):
            raise TypeError(_NUMPY_ERROR)
        if _is_cuda(kwargs.get("device")):  # a factory, or new_*(device=cuda)
            _check_generators(tree_flatten((args, kwargs))[0], True)
            host = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
            host = [t for t in host if not is_fake(t)]
            u_args = tree_map(_unwrap, args)
            u_kwargs = {**tree_map(_unwrap, kwargs), "device": torch.device("cpu")}
            out = func(*u_args, **u_kwargs)
            out = fake_graphs.record(
                func, u_args, u_kwargs, out, False, fills=func not in _ALLOCATIONS
            )

            def own(t):  # a fresh device tensor never aliases host memory
                if isinstance(t, torch.Tensor) and any(_shares(t, h) for h in host):
                    return FakeCudaTensor(t.clone())
                return _wrap(t)

            if func in _FROM_HOST_DATA:  # their copy to the device blocks
                _count_h2d(True)
            if func not in _ALLOCATIONS:  # a fill, a range, a copy of host data
                _count_kernel(func.__name__)
            return tree_map(own, out)
        try:
            return func(*args, **kwargs)
        except RuntimeError as err:  # a Python binding that sets a CUDA device guard first
            if "not linked with support for cuda" not in str(err):
                raise
        return self._unguarded(func, args, kwargs)

    # ------------------------------------------------------------------ special calls
    def _to(self, func, args, kwargs):
        self_ = args[0]
        if func is torch.Tensor.cuda:
            device, dtype, copied = FAKE_CUDA, None, False
            non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2])
        else:
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            copied = kwargs.get("copy", False)
        if not _is_cuda(device):
            return func(*args, **kwargs)  # dispatch counts a copy to the host
        elem = _unwrap(self_)
        dtype = dtype or elem.dtype
        if is_fake(self_):
            if dtype == elem.dtype and not copied:
                return self_
            kwargs = {"dtype": dtype, "copy": copied}
            out = fake_graphs.record(torch.Tensor.to, (elem,), kwargs, elem.to(**kwargs), False)
            return FakeCudaTensor(out)
        _count_h2d(not non_blocking)
        _count_kernel("to")
        return FakeCudaTensor(elem.to(dtype=dtype, copy=True))

    @staticmethod
    def _unguarded(func, args, kwargs):
        """func on the CPU tensors, with the dispatcher's checks and counts by name."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if _mixes(tensors):
            raise RuntimeError(_SAME_DEVICE_ERROR.format(op=func.__name__))
        if func.__name__ in ("nonzero", "argwhere", "masked_select", "unique"):
            _count(func.__name__)
        _count_kernel(func.__name__)
        u_args, u_kwargs = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
        out = fake_graphs.record(func, u_args, u_kwargs, func(*u_args, **u_kwargs), True)
        return tree_map(_wrap, out)

    def _getitem(self, self_, index):
        indices = [i for i in tree_flatten(index)[0] if isinstance(i, torch.Tensor)]
        if not is_fake(self_):
            if any(is_fake(i) for i in indices):
                raise IndexError(_INDEX_ERROR)
            return torch.Tensor.__getitem__(self_, index)
        if any(is_fake(i) and i.dtype in _MASKS for i in indices):
            _count("mask index")
        if any(not is_fake(i) and i.dim() > 0 for i in indices):
            fake_graphs.refuse("a host index tensor")
        if indices:  # advanced indexing gathers; a basic index is a view
            _count_kernel("index")
        args = (self_.elem, tree_map(_unwrap, index))
        out = torch.Tensor.__getitem__(*args)
        return _wrap(fake_graphs.record(torch.Tensor.__getitem__, args, {}, out, False))

    def _setitem(self, self_, index, value):
        indices = [i for i in tree_flatten(index)[0] if isinstance(i, torch.Tensor)]
        advanced = bool(indices)
        if not is_fake(self_):
            if any(is_fake(i) for i in indices):
                raise IndexError(_INDEX_ERROR)
            if is_fake(value) and value.dim() > 0:
                if advanced:
                    raise RuntimeError(_SAME_DEVICE_ERROR.format(op="index_put_"))
                _count("to host")
            return torch.Tensor.__setitem__(self_, index, _unwrap(value))
        if any(is_fake(i) and i.dtype in _MASKS for i in indices):
            _count("mask index")
        if isinstance(value, torch.Tensor) and not is_fake(value) and value.dim() > 0:
            if advanced:  # index_put_ takes its values on self's device only
                raise RuntimeError(_SAME_DEVICE_ERROR.format(op="index_put_"))
            _count_h2d(True)  # a slice's copy_ from the host: legal, and blocking
        if any(not is_fake(i) and i.dim() > 0 for i in indices):
            fake_graphs.refuse("a host index tensor")
        _count_kernel("index_put_" if advanced else "copy_")
        args = (self_.elem, tree_map(_unwrap, index), _unwrap(value))
        torch.Tensor.__setitem__(*args)
        fake_graphs.record(torch.Tensor.__setitem__, args, {}, None, True)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type != "cpu" or b.device.type != "cpu" or not a.numel() or not b.numel():
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class FakeCuda:
    """Run code as if on a CUDA device (see the module's docstring).

        with FakeCuda() as dev:
            engine.step()
        dev.syncs   # Counter: host syncs by kind
        dev.sites   # Counter: host syncs by where in service/, workers/ or verification/

    While active, the verifiers' Triton kernels are off (they need a GPU): the verifiers run
    the torch-ops path a GPU runs where no kernel applies. CUDA graphs are off too (verify
    calls run eagerly; the decode step's emulated graphs count a replay as one launch), or
    with ``graphs=True`` they capture and replay on the fake device as on a GPU
    (tests/fake_graphs.py: ``torch.cuda.is_available()`` is True, ``captures`` counts them)."""

    def __init__(self, graphs: bool = False) -> None:
        self.graphs = graphs
        self.captures = 0  # graphs captured (graphs=True)
        self.syncs: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        self.h2d = 0
        self.kernels: Counter[str] = Counter()  # kernels launched eagerly, by op
        self.kernel_sites: Counter[str] = Counter()  # and by file and function
        self._graphed = False  # inside a graph's replay or capture: its kernels are one launch
        self._modes = (FakeCudaMode(), _FakeDispatchMode())
        self._saved: list[tuple[object, str, object]] = []

    @property
    def total(self) -> int:
        """Host syncs so far."""
        return sum(self.syncs.values())

    @property
    def launches(self) -> int:
        """Kernels launched eagerly so far, a graph's replay one of them."""
        return sum(self.kernels.values())

    def reset(self) -> None:
        self.syncs.clear()
        self.sites.clear()
        self.h2d = 0
        self.kernels.clear()
        self.kernel_sites.clear()

    def _verify(self, cache, fn, *inputs):
        """VerifyGraphs.run: the verifier called eagerly, counted as a GPU runs it: a replay
        with its inputs' copies in and outputs' copies out, or eager where its inputs are too
        large for a graph (verification/graphs.py)."""
        from blockspec.verification import graphs

        tensors = graphs._flatten(inputs)
        if not graphs.fits_graph(tensors):
            return fn(*inputs)
        for _ in tensors:
            _count_kernel("copy_")
        out = _as_graph(fn)(*inputs)
        for _ in tree_flatten(out)[0] if cache.copies else ():
            _count_kernel("clone")
        return out

    def _patch(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> FakeCuda:
        from blockspec.verification import graphs, kernels
        from blockspec.workers.graphs import CallGraphs, ForwardGraphs

        self._patch(kernels, "available", lambda: False)  # Triton kernels need a GPU
        if self.graphs:
            self._patch(torch.cuda, "is_available", lambda: True)
            for name in ("CUDAGraph", "graph", "Stream", "current_stream", "stream"):
                self._patch(torch.cuda, name, getattr(fake_graphs, name))
            return self._activate()
        self._patch(
            graphs.VerifyGraphs, "run", lambda cache, _method, fn, *a: self._verify(cache, fn, *a)
        )
        for owner in (ForwardGraphs, CallGraphs):  # emulated graphs: a replay counts once
            self._patch(owner, "_capture", _capture_as_graph(owner._capture))
        return self._activate()

    def _activate(self) -> FakeCuda:
        _ACTIVE.append(self)
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        _ACTIVE.remove(self)
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)


def to_fake(obj):
    """Tensors inside obj (dicts, lists, tuples) as FakeCudaTensors (copies)."""
    if isinstance(obj, torch.Tensor):
        return obj if is_fake(obj) else FakeCudaTensor(obj.detach().clone())
    if isinstance(obj, dict):
        return {k: to_fake(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_fake(x) for x in obj)
    return obj


def to_fake_model(model):
    """A copy of a ``workers.llama.Llama`` built on the CPU, its tensors on the fake device
    (weights packed for oneDNN cannot move: build the model with ``packed=False``)."""
    from blockspec.workers.llama import Linear

    if any(isinstance(m, Linear) and m.packed for m in model.modules()):
        raise ValueError("a packed weight cannot move to the fake device")
    fake = copy.deepcopy(model)
    for module in fake.modules():  # every weight of the model is a buffer (see Llama)
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, to_fake(buffer))
    return fake
