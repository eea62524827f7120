"""The decode step's forwards compiled by torch.compile: on a CPU, inductor's C++ backend with
freezing; on CUDA, its Triton kernels, captured in the decode graphs (workers/graphs.py).

Why: eagerly, a CPU decode forward of SmolLM2-135M spends about as long outside its weights'
products as in them: ~25 small ops a layer (norms, RoPE, attention's pieces, residuals), each a
dispatch from Python. Compiled, those fuse into a few generated C++ loops called from a C++
wrapper (`cpp_wrapper`), and freezing hands inductor the weights as constants, which it packs
for oneDNN itself and multiplies from the generated code. docs/benchmarks.md ("Compiled decode
forwards") has the numbers.

What is compiled: ``Llama``'s forward for calls over the worker's own cache at slot 0 (the
target's tree pass and the draft's pending run), reading a bucketed prefix window
(graphs.prefix_window), with dynamic shapes; and on a CPU the draft's whole proposal past its
pending run (`CompiledCalls`: every depth's forward, head, law and draw in one call). Dynamo
still specializes sizes 0 and 1, so each worker compiles once per kind of call it meets (one
request or more, one new token or more; for the proposal, each K, γ, prefix window and law)
and per torch thread count: about a minute each for the default target on 2 cores, seconds
for its draft, paid in the first steps that meet them (a warm-up's). Prefill, forks and
calls over other caches stay eager. Freezing bypasses inductor's on-disk cache: each process
compiles again.

The weights must be dense (``Llama(..., packed=False)``): inductor cannot multiply by a weight
packed outside it. Its packed copies sit beside the dense ones, which eager calls still read.

On CUDA a forward is bound by its ~20 kernels a layer (docs/gpu.md), which a CUDA graph
replays but does not merge: compiled, inductor fuses the norms, RoPE, residuals and
attention's pieces into a few Triton kernels a layer, and the decode graphs capture those
(`TargetWorker.use_graphs(compiled=True)`, ``build_engine(..., compiled=True)`` on CUDA):
the same static shapes per bucket, fewer kernels in each. Not yet run on a GPU.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blockspec.workers.graphs import OwnCacheForward, graphs_available, prefix_window
from blockspec.workers.llama import KVCache, Linear, Llama

# Dynamo compiles a code object at most this many times (each worker's model calls the same
# forward: the draft's and the target's kinds of call share the count); past it, eager.
RECOMPILE_LIMIT = 64
# Set around each CPU call (a compile happens inside one): torch.compile's `options` do not
# reach freezing, which inductor reads outside them. Freezing packs each weight for oneDNN and
# multiplies it there, as the eager packed Linear does. No max_autotune: for the default
# target its C++ GEMM template lost to oneDNN's packed product at one new token, and at 9 it
# kept oneDNN's (docs/benchmarks.md, "Compiled decode forwards").
INDUCTOR = {"freezing": True, "cpp_wrapper": True}


@dataclass(frozen=True)
class DecodeForwards:
    """How a worker runs the decode step's forwards: replayed from CUDA graphs where they run
    (`cuda_graphs`), through torch.compile with `compiled` (inside the graphs on CUDA), else
    eagerly. What a deployment's config sets (service/config.py) and its actors apply."""

    cuda_graphs: bool = True
    compiled: bool = False

    @property
    def packed(self) -> bool | None:
        """Llama's `packed`: compiled forwards need dense weights (inductor packs them itself);
        None: Llama packs what packs_weights picks."""
        return False if self.compiled else None

    def use(self, worker) -> None:
        """Switch `worker` (a TargetWorker or a draft proposer) to these forwards."""
        if self.cuda_graphs and graphs_available(worker.device):
            worker.use_graphs(compiled=self.compiled)
        elif self.compiled:
            worker.use_compiled()


DEFAULT_FORWARDS = DecodeForwards()  # CUDA graphs where they run, else eager; not compiled


def compiles_on(device: str | torch.device) -> bool:
    """Whether decode forwards on `device` can be compiled here: inductor's C++ backend on a
    CPU, its Triton kernels on CUDA."""
    return torch.device(device).type in ("cpu", "cuda")


def compile_forward(model: Llama) -> Callable:
    """``model``'s forward (same arguments, `window` included) through torch.compile, compiling
    on first use of each kind of call. Raises ValueError for packed weights."""
    packed = [name for name, m in model.named_modules() if isinstance(m, Linear) and m.packed]
    if packed:
        raise ValueError(
            f"compiled forwards need dense weights (Llama(packed=False)); packed: {packed[0]}"
        )
    device = model.embed.device
    if not compiles_on(device):
        raise ValueError(f"compiled forwards run on a CPU or CUDA, not {device}")
    return _compiling(_compile(traced_forward(model)), device)


def traced_forward(model: Llama) -> Callable:
    """``model``'s forward as torch.compile traces it (same arguments, `window` included)."""
    # undecorated: dynamo cannot trace views of inference tensors (inference_mode), so the
    # compiled call runs under no_grad instead
    return functools.partial(inspect.unwrap(type(model).forward), model)


def _own_code(fn: Callable) -> Callable:
    """`fn` (a function, or a partial of one) calling a copy of its function with a code object
    of its own: dynamo keeps its graphs per code object."""
    if isinstance(fn, functools.partial):
        return functools.partial(_own_code(fn.func), *fn.args, **fn.keywords)
    code, closure = fn.__code__.replace(), fn.__closure__
    own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    own.__kwdefaults__ = fn.__kwdefaults__
    return own


def _compile(fn: Callable) -> Callable:
    """torch.compile of `fn` with a code object of its own (`_own_code`), guarded on its inputs
    but not on the modules it reads.

    Why: dynamo checks every guard of a graph before each call, ~2,500 for the default target
    (~1 ms a call, 0.12 ms without them), nearly all on the model's modules: their types and
    attribute dicts, which never change once the model is built, and freezing makes the
    weights constants anyway. Without those guards, a graph made for one model could serve
    another's call if dynamo kept them together: it keeps a code object's graphs together,
    and every Llama shares Llama.forward's. So each compiled function gets its own code, and
    its graphs see one model (each caller compiles for one model)."""
    filters = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    return torch.compile(_own_code(fn), dynamic=True, options=filters)


def _compiling(compiled: Callable, device: torch.device) -> Callable:
    """`compiled` called as inductor needs on `device` (see INDUCTOR)."""
    # imported here, not with the module: torch._inductor brings dynamo along (~1 s), which
    # every process that imports the workers would pay, an actor's restart included, though
    # only compiled forwards use it
    from torch._inductor import config as inductor_config

    torch._dynamo.config.recompile_limit = max(
        torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT
    )
    options = INDUCTOR if device.type == "cpu" else {}

    def call(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad(), inductor_config.patch(options):
            return compiled(*args, **kwargs)

    return call


class CompiledForward(OwnCacheForward):
    """``model(...)`` over `cache` for decode calls, through ``compile_forward``; a call over
    another cache or slot runs eagerly. Same signature and outputs as ``Llama.forward``."""

    def __init__(self, model: Llama, cache: KVCache):
        self.model, self.cache = model, cache
        self._compiled = compile_forward(model)
        # what a call that CompiledCalls compiles runs as the forward (traced with it)
        self.captured = traced_forward(model)

    def _own(self, tokens, positions, mask, suffix, features, head) -> tuple:
        # a bucketed window: the prefix length never specializes (0, 1) nor recompiles
        window = prefix_window(self.cache, tokens.shape[0])
        args = (tokens, positions, self.cache, mask, suffix, 0, features, head, window)
        return self._compiled(*args)


def _call(fn: Callable, *inputs: torch.Tensor):
    return fn(*inputs)


class CompiledCalls:
    """``fn(*inputs)`` through torch.compile, forwards included: the draft's proposal past its
    pending run (`DraftProposer._paths` over `CompiledForward.captured`) as one compiled call,
    where compiled forwards a depth each paid dynamo's guard check (~0.5 ms a call) and ran
    the head, the law and the draw eagerly between them. The same interface as CUDA's
    `CallGraphs`: `fn` closes over the call's settings (a partial: K, γ, the prefix window,
    the law's steps), on which dynamo's guards key its graphs; the caller's `key` names the
    same settings and is not needed here."""

    def __init__(self, device: str | torch.device = "cpu"):
        # one proposer's graphs (its draft model's) for each CompiledCalls (see _compile)
        self._compiled = _compiling(_compile(_call), torch.device(device))

    def run(self, key: tuple, fn: Callable, *inputs: torch.Tensor):
        return self._compiled(fn, *inputs)
