"""Lossless draft-verification algorithms, batched over requests.

    from blockspec.verification import verify, METHODS
    out = verify(method, draft_tokens, draft_probs, target_probs, generator=None)

Shapes: ``draft_tokens`` int64 [B, K, γ] (K i.i.d. draft paths per request), ``draft_probs``
[B, K, γ, V] (q(·| context, first i tokens of path k), the *processed* distribution each token
was sampled from), ``target_probs`` [B, K, γ+1, V] (p(·| context, first i tokens of path k));
rows of identical prefixes must be identical. :class:`VerifyOutput` is the result.

Vocabulary (one iteration of speculative decoding, spec §0):

- *draft path*: γ tokens sampled from the processed draft distribution q; K i.i.d. paths per
  request form the draft tree (identical prefixes merge).
- *accepted*: τ ∈ [0, γ] draft tokens, a prefix of one path (``VerifyOutput.path``).
- *recovered* (correction): when τ < γ, one token sampled from the method's residual law.
- *bonus*: when τ = γ, one token sampled from the target row after the full path.
- *emitted*: accepted + one recovered/bonus token, ``τ + 1`` tokens in all.

The math of every method is specified in ``docs/verification.md`` (section numbers are
quoted in each module). ``greedy_block`` and ``spectr_gbv`` change the target for later steps:
thread ``out.carry`` into the next ``verify`` call of the same requests (``carry=``).

Which code runs is decided once a call, by :func:`choose_backend` (backends.py): each
:class:`Verifier` maps every backend to the function that runs there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from . import block, gbv, greedy, token, top_down, traversal
from .backends import Backend, check_backend, choose_backend
from .common import ROW_SUM_TOL, CounterDraws, Generators, check_inputs, draw_uniforms
from .graphs import VerifyGraphs
from .modification import TargetModification, advance_records, apply_records

__all__ = [
    "METHODS",
    "ROW_SUM_TOL",
    "VERIFIERS",
    "Backend",
    "CounterDraws",
    "TargetModification",
    "Verifier",
    "VerifyGraphs",
    "VerifyOutput",
    "choose_backend",
    "load_cpu_kernels",
    "verify",
]


@dataclass(frozen=True)
class VerifyOutput:
    """Result of one verification call for a batch of B requests."""

    # [B, γ+1] int64: emitted tokens (accepted prefix, then recovered/bonus), -1 padded
    tokens: torch.Tensor
    num_tokens: torch.Tensor  # [B] int64: τ + 1
    num_accepted: torch.Tensor  # [B] int64: τ, accepted draft tokens (position i < τ was accepted)
    path: torch.Tensor  # [B] int64: index of a draft path whose prefix was accepted
    carry: TargetModification | None = None  # for methods that modify the target, else None


@dataclass(frozen=True)
class Verifier:
    name: str
    # backend -> fn(backend, draft_tokens, draft_probs, target_probs, uniforms [B, num_uniforms]
    #   [, modified rows]) -> (tokens, τ, path[, new modification records]); a method that
    #   modifies the target also takes the carried modification as ResidualRows over the
    #   unmodified target rows. The torch functions serve several backends and read its flags.
    implementations: Mapping[Backend, Callable]
    num_uniforms: Callable[[int, int], int]  # (K, γ) -> uniforms per request
    single_path: bool  # K must be 1
    modifies_target: bool  # returns modification records to carry (spec §3.2, §10)
    description: str


def _torch_ops(fn: Callable, numba: Callable | None = None) -> dict[Backend, Callable]:
    """fn on every backend, or ``numba`` (compiled loops) in its place on the numba backend."""
    return {backend: fn for backend in Backend} | ({Backend.NUMBA: numba} if numba else {})


_GBV = {
    Backend.NUMBA: gbv.gbv_verify_loops,
    Backend.TORCH_HOST: gbv.gbv_verify_lazily,
    Backend.TORCH_DEVICE: gbv.gbv_verify_all_levels,
    Backend.TRITON: gbv.gbv_verify_all_levels,
}
_GREEDY = _torch_ops(greedy.sequential_greedy_verify, greedy.greedy_verify_loops)

VERIFIERS: dict[str, Verifier] = {
    v.name: v
    for v in [
        Verifier(
            "token",
            _torch_ops(token.token_verify),
            token.num_uniforms,
            True,
            False,
            "token verification (§1)",
        ),
        Verifier(
            "block",
            _torch_ops(block.block_verify),  # block_verify_rows takes the loop on numba
            block.num_uniforms,
            True,
            False,
            "block verification (§2)",
        ),
        Verifier(
            "greedy_block",
            _GREEDY,
            greedy.num_uniforms,
            True,
            True,
            "greedy block verification with carried modification (§3)",
        ),
        Verifier(
            "naive",
            _torch_ops(top_down.naive_verify),
            top_down.num_uniforms,
            False,
            False,
            "naive sampling, NSS (§5)",
        ),
        Verifier(
            "specinfer",
            _torch_ops(top_down.specinfer_verify),
            top_down.num_uniforms,
            False,
            False,
            "SpecInfer recursive rejection sampling (§6)",
        ),
        Verifier(
            "spectr",
            _torch_ops(top_down.spectr_verify),
            top_down.num_uniforms,
            False,
            False,
            "SpecTr K-SEQ over the draft tree (§7)",
        ),
        Verifier(
            "gbv", _GBV, gbv.num_uniforms, False, False, "greedy multi-path block verification (§8)"
        ),
        Verifier(
            "traversal",
            _torch_ops(traversal.traversal_verify, traversal.traversal_verify_loops),
            traversal.num_uniforms,
            False,
            False,
            "traversal verification (§9)",
        ),
        Verifier(
            "spectr_gbv",
            _GREEDY,
            greedy.num_uniforms,
            False,
            True,
            "SpecTr-GBV*, the spec's reconstruction of Lin et al. (§10), with carried modification",
        ),
    ]
}

METHODS: tuple[str, ...] = tuple(VERIFIERS)


def verify(
    method: str,
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
    generator: Generators = None,
    *,
    carry: TargetModification | None = None,
    validate: bool = True,
    check_tokens: bool = True,
    graphs: VerifyGraphs | None = None,
    backend: Backend | str | None = None,
) -> VerifyOutput:
    """Verify one draft block (or tree) per request and emit accepted tokens + one more.

    generator: None, one torch.Generator for the batch, a sequence of B generators (one per
    request: results are then independent of batch composition), or CounterDraws (per-request
    keys and counters: independent of batch composition, and no state).
    carry: for ``greedy_block`` / ``spectr_gbv``, the ``out.carry`` of the previous call on the
    same requests (None on a request's first step). Other methods reject a carry.
    validate: check values (NaN, negatives, row sums within ROW_SUM_TOL, q(drafted) > 0) at
    the cost of ~2 passes over the inputs; shapes and dtypes are always checked.
    check_tokens: raise when a draft token lies outside [0, V) (on an accelerator a host read);
    False: the caller has made sure, as the engine does without reading the device
    (workers/step.py: the verdict's `out_of_vocab` flags).
    graphs: on CUDA, replay the method's kernels from a graph captured per shape bucket
    (verification/graphs.py): the same tokens without the launch cost. None: eager.
    backend: which code runs (backends.py); None: :func:`choose_backend`'s choice for the
    inputs. Naming one (tests, benchmarks) runs e.g. an accelerator's fixed-shape torch ops on
    the CPU: every backend gives the same tokens, up to the compiled loops' rounding.
    """
    spec = VERIFIERS.get(method)
    if spec is None:
        raise ValueError(
            f"unknown verification method {method!r}; expected one of {', '.join(METHODS)}"
        )
    check_inputs(
        method, spec.single_path, draft_tokens, draft_probs, target_probs, validate, check_tokens
    )
    B, K, gamma = draft_tokens.shape
    if carry is not None and not spec.modifies_target:
        raise ValueError(f"method {method!r} does not modify the target; carry must be None")
    if carry is not None and carry.batch_size != B:
        raise ValueError(f"carry holds {carry.batch_size} requests, the batch has {B}")
    if backend is None:
        backend = choose_backend(draft_probs, target_probs)
    else:
        backend = Backend(backend)
        check_backend(backend, draft_probs, target_probs)

    uniforms = draw_uniforms(generator, B, spec.num_uniforms(K, gamma), draft_tokens.device)
    fn = functools.partial(spec.implementations[backend], backend)
    run = fn if graphs is None else functools.partial(graphs.run, method, fn)
    if not spec.modifies_target:
        tokens, tau, path = run(draft_tokens, draft_probs, target_probs, uniforms)
        return VerifyOutput(tokens, tau + 1, tau, path)

    carry = carry if carry is not None else TargetModification.empty(B, draft_tokens.device)
    if graphs is not None and not backend.reads_host:  # the width records reach in γ steps (K
        carry = carry.widened(gamma * K)  # a step) from the first: one graph, not one a width
    records = (carry.log_p, carry.log_q, carry.rows_left)
    call = functools.partial(_carrying, fn, backend)
    if graphs is not None and not backend.reads_host:  # the records too: one graph a call
        out = graphs.run(f"{method} with records", call, draft_tokens, draft_probs,
                         target_probs, uniforms, *records)  # fmt: skip
    else:
        out = call(draft_tokens, draft_probs, target_probs, uniforms, *records)
    tokens, tau, path, *new_records = out
    return VerifyOutput(tokens, tau + 1, tau, path, TargetModification(*new_records))


def _carrying(
    fn: Callable,  # the verifier's function on its backend
    backend: Backend,
    draft_tokens: torch.Tensor,  # [B, K, γ]
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
    uniforms: torch.Tensor,  # [B, n]
    log_p: torch.Tensor,  # [B, R]: the carried records (TargetModification)
    log_q: torch.Tensor,  # [B, R]
    rows_left: torch.Tensor,  # [B, R]
) -> tuple[torch.Tensor, ...]:
    """A carrying method's call: the records applied to the target rows, the verifier, the
    records advanced by what it emitted. Returns (tokens, τ, path, and the new records'
    log_p, log_q, rows_left), each batch-first: off the CPU a pure function of fixed shapes,
    which a graph replays whole (the records' ~20 small kernels a record otherwise launch
    eagerly)."""
    carry = TargetModification(log_p, log_q, rows_left)
    modified, record_rows = apply_records(carry, draft_tokens, draft_probs, target_probs, backend)
    tokens, tau, path, (new_log_p, new_log_q, new_rows_left) = fn(
        draft_tokens, draft_probs, target_probs, uniforms, modified
    )
    new_carry = advance_records(
        carry,
        record_rows,
        emitted=tokens[:, : draft_tokens.shape[2]],
        num_emitted=tau + 1,
        path=path,
        draft_probs=draft_probs,
        target_probs=target_probs,
        new_log_p=new_log_p,
        new_log_q=new_log_q,
        new_rows_left=new_rows_left,
        backend=backend,
    )
    return tokens, tau, path, new_carry.log_p, new_carry.log_q, new_carry.rows_left


@functools.cache
def load_cpu_kernels(steps: int = 3) -> None:
    """Verify a small batch with every method, `steps` calls each (a carrying method's later
    calls with its carry, which the rejections of the calls before leave records in), on the
    CPU: each method's compiled loops load now, not while a request waits. numba reads them
    from its on-disk cache on a kernel's first call in a process: ~0.4 s before the first
    method's first verdict, up to ~50 ms for each method after it. Once a process: every
    engine or actor built after the first finds them loaded."""
    gen = torch.Generator().manual_seed(1)
    batch, gamma, vocab = 8, 2, 64

    def rows(k: int, length: int) -> torch.Tensor:  # [B, K, length, V], peaked, none 0
        out = torch.randn(batch, k, length, vocab, generator=gen).mul(3).softmax(-1)
        out[:, 1:, 0] = out[:, :1, 0]  # the paths' first rows share their context
        return out

    for method, verifier in VERIFIERS.items():
        k = 1 if verifier.single_path else 2
        q, p = rows(k, gamma), rows(k, gamma + 1)
        x = torch.randint(0, vocab, (batch, k, gamma), generator=gen)
        x[:, :, 0] = torch.arange(k)  # distinct first tokens: every later row may differ
        carry = None
        for counter in range(steps):
            draws = CounterDraws(torch.tensor([[1, counter]] * batch, dtype=torch.int64))
            carry = verify(method, x, q, p, draws, carry=carry).carry
