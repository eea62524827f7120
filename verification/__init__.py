"""Lossless draft-verification algorithms, batched over requests.

    from verification import verify, METHODS
    out = verify(method, draft_tokens, draft_probs, target_probs, generator=None)

Shapes: ``draft_tokens`` int64 [B, K, γ] (K i.i.d. draft paths per request), ``draft_probs``
[B, K, γ, V] (q(·| context, first i tokens of path k), the *processed* distribution each token
was sampled from), ``target_probs`` [B, K, γ+1, V] (p(·| context, first i tokens of path k));
rows of identical prefixes must be identical. See :mod:`verification.common` for the
vocabulary (accepted / recovered / bonus) and :class:`VerifyOutput` for the result.

The math of every method is specified in ``docs/verification.md`` (section numbers are
quoted in each module). ``greedy_block`` and ``spectr_gbv`` change the target for later steps:
thread ``out.carry`` into the next ``verify`` call of the same requests (``carry=``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import block, gbv, greedy, token, top_down, traversal
from .common import ROW_SUM_TOL, Generators, VerifyOutput, check_inputs, draw_uniforms
from .graphs import VerifyGraphs
from .modification import TargetModification, advance_records, apply_records

__all__ = [
    "METHODS",
    "ROW_SUM_TOL",
    "VERIFIERS",
    "TargetModification",
    "Verifier",
    "VerifyGraphs",
    "VerifyOutput",
    "verify",
]


@dataclass(frozen=True)
class Verifier:
    name: str
    # (draft_tokens, draft_probs, target_probs, uniforms [B, num_uniforms][, modified rows])
    #   -> (tokens, τ, path[, new modification records]); a method that modifies the target
    #   also takes the carried modification as ResidualRows over the unmodified target rows.
    fn: Callable
    num_uniforms: Callable[[int, int], int]  # (K, γ) -> uniforms per request
    single_path: bool  # K must be 1
    modifies_target: bool  # returns modification records to carry (spec §3.2, §10)
    description: str


VERIFIERS: dict[str, Verifier] = {
    v.name: v
    for v in [
        Verifier(
            "token", token.token_verify, token.num_uniforms, True, False, "token verification (§1)"
        ),
        Verifier(
            "block", block.block_verify, block.num_uniforms, True, False, "block verification (§2)"
        ),
        Verifier(
            "greedy_block",
            greedy.sequential_greedy_verify,
            greedy.num_uniforms,
            True,
            True,
            "greedy block verification with carried modification (§3)",
        ),
        Verifier(
            "naive",
            lambda *a: top_down.walk_tree(top_down.naive_rule, *a),
            top_down.num_uniforms,
            False,
            False,
            "naive sampling, NSS (§5)",
        ),
        Verifier(
            "specinfer",
            top_down.single_candidate_is_token(top_down.specinfer_rule),
            top_down.num_uniforms,
            False,
            False,
            "SpecInfer recursive rejection sampling (§6)",
        ),
        Verifier(
            "spectr",
            top_down.single_candidate_is_token(top_down.spectr_rule),
            top_down.num_uniforms,
            False,
            False,
            "SpecTr K-SEQ over the draft tree (§7)",
        ),
        Verifier(
            "gbv",
            gbv.gbv_verify,
            gbv.num_uniforms,
            False,
            False,
            "greedy multi-path block verification (§8)",
        ),
        Verifier(
            "traversal",
            traversal.traversal_verify,
            traversal.num_uniforms,
            False,
            False,
            "traversal verification (§9)",
        ),
        Verifier(
            "spectr_gbv",
            greedy.sequential_greedy_verify,
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
    graphs: VerifyGraphs | None = None,
) -> VerifyOutput:
    """Verify one draft block (or tree) per request and emit accepted tokens + one more.

    generator: None, one torch.Generator for the batch, or a sequence of B generators (one per
    request: results are then independent of batch composition).
    carry: for ``greedy_block`` / ``spectr_gbv``, the ``out.carry`` of the previous call on the
    same requests (None on a request's first step). Other methods reject a carry.
    validate: check values (NaN, negatives, row sums within ROW_SUM_TOL, q(drafted) > 0) at
    the cost of ~2 passes over the inputs; shapes, dtypes and token ranges are always checked.
    graphs: on CUDA, replay the method's kernels from a graph captured per shape bucket
    (verification/graphs.py): the same tokens without the launch cost. None: eager.
    """
    spec = VERIFIERS.get(method)
    if spec is None:
        raise ValueError(
            f"unknown verification method {method!r}; expected one of {', '.join(METHODS)}"
        )
    check_inputs(method, spec.single_path, draft_tokens, draft_probs, target_probs, validate)
    B, K, gamma = draft_tokens.shape
    if carry is not None and not spec.modifies_target:
        raise ValueError(f"method {method!r} does not modify the target; carry must be None")
    if carry is not None and carry.batch_size != B:
        raise ValueError(f"carry holds {carry.batch_size} requests, the batch has {B}")

    uniforms = draw_uniforms(generator, B, spec.num_uniforms(K, gamma), draft_tokens.device)
    run = spec.fn if graphs is None else functools.partial(graphs.run, method, spec.fn)
    if not spec.modifies_target:
        tokens, tau, path = run(draft_tokens, draft_probs, target_probs, uniforms)
        return VerifyOutput(tokens, tau + 1, tau, path)

    carry = carry if carry is not None else TargetModification.empty(B, draft_tokens.device)
    modified, record_rows = apply_records(carry, draft_tokens, draft_probs, target_probs)
    tokens, tau, path, (log_p, log_q, rows_left) = run(
        draft_tokens, draft_probs, target_probs, uniforms, modified
    )
    new_carry = advance_records(
        carry,
        record_rows,
        emitted=tokens[:, :gamma],
        num_emitted=tau + 1,
        path=path,
        draft_probs=draft_probs,
        target_probs=target_probs,
        new_log_p=log_p,
        new_log_q=log_q,
        new_rows_left=rows_left,
    )
    return VerifyOutput(tokens, tau + 1, tau, path, new_carry)
