"""CUDA graphs for verification (verification/graphs.py): replays give eager's tokens.

The CUDA tests run where a device is present (scripts/gpu_checks.sh); on CPU graphs never
apply, which the first tests check.
"""

from __future__ import annotations

import pytest
import torch

from blockspec.verification import METHODS, VERIFIERS, VerifyGraphs, verify
from blockspec.verification import graphs as verify_graphs
from blockspec.verification.graphs import batch_bucket
from blockspec.verification.modification import ResidualRows
from tests.test_verify_cost import inputs, same_tokens

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_batch_bucket_is_the_next_power_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]


def test_a_call_s_inputs_become_buffers_and_back():
    """A graph's static buffers are its inputs' tensors, ResidualRows as their two scalars;
    the call is rebuilt over the buffers with the inputs' structure (a carrying call's records
    are three more tensors after the uniforms)."""
    rows = ResidualRows(
        torch.zeros(2, 1, 3, dtype=torch.float64), torch.ones(2, 1, 3, dtype=torch.float64), True
    )
    inputs = (torch.zeros(2, 1, 3), rows, torch.ones(2, 4), torch.zeros(2, 0))
    flat = verify_graphs._flatten(inputs)
    assert [tuple(t.shape) for t in flat] == [(2, 1, 3), (2, 1, 3), (2, 1, 3), (2, 4), (2, 0)]
    buffers = [t.clone() for t in flat]
    rebuilt = verify_graphs._unflatten(inputs, buffers)
    assert isinstance(rebuilt[1], ResidualRows) and rebuilt[1].unmodified
    assert rebuilt[1].z is buffers[2] and rebuilt[3] is buffers[4] and len(rebuilt) == 4


@pytest.mark.parametrize("method", METHODS)
def test_graphs_leave_cpu_calls_eager(method):
    k = 1 if VERIFIERS[method].single_path else 2
    tokens, q, p = inputs("realistic", 3, k, 4)
    graphs = VerifyGraphs()
    out = verify(method, tokens, q, p, torch.Generator().manual_seed(0), graphs=graphs)
    ref = verify(method, tokens, q, p, torch.Generator().manual_seed(0))
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.path, ref.path)
    assert len(graphs) == 0  # nothing captured


@cuda
@pytest.mark.parametrize("method", METHODS)
def test_replays_give_the_eager_tokens_at_every_batch_size(method):
    """Batches 5, 3, 8 and 5 again: buckets 8, 4 and 8 (replayed); pad rows never leak."""
    k = 1 if VERIFIERS[method].single_path else 3
    graphs = VerifyGraphs()
    for step, (b, regime) in enumerate(
        [(5, "realistic"), (3, "agree"), (8, "disjoint"), (5, "agree")]
    ):
        tokens, q, p = inputs(regime, b, k, 6, vocab=500, device="cuda")
        gen = torch.Generator("cuda")
        eager = verify(method, tokens, q, p, gen.manual_seed(step), validate=False)
        graphed = verify(method, tokens, q, p, gen.manual_seed(step), validate=False, graphs=graphs)
        assert same_tokens(eager, graphed), (step, b)
    assert len(graphs) == 2 and graphs.eager_shapes == 0  # one graph per bucket


@cuda
@pytest.mark.parametrize("method", [m for m in METHODS if VERIFIERS[m].modifies_target])
def test_replays_thread_the_same_carry(method):
    """Three steps of the same requests: the records each step leaves modify the next one."""
    k = 1 if VERIFIERS[method].single_path else 3
    graphs = VerifyGraphs()
    carry_eager = carry_graphed = None
    for step, regime in enumerate(["disjoint", "realistic", "disjoint"]):
        tokens, q, p = inputs(regime, 6, k, 5, vocab=300, device="cuda")
        gen = torch.Generator("cuda")
        eager = verify(method, tokens, q, p, gen.manual_seed(step), carry=carry_eager)
        graphed = verify(
            method, tokens, q, p, gen.manual_seed(step), carry=carry_graphed, graphs=graphs
        )
        assert same_tokens(eager, graphed), step
        carry_eager, carry_graphed = eager.carry, graphed.carry
        for field in ("log_p", "log_q", "rows_left"):
            assert torch.equal(getattr(carry_eager, field), getattr(carry_graphed, field))


@cuda
def test_buffers_beyond_the_byte_budget_evict_the_least_recently_used():
    tokens, q, p = inputs("realistic", 8, 1, 6, vocab=500, device="cuda")
    one_bucket = sum(t.numel() * t.element_size() for t in (tokens, q, p)) + 8 * 8 * 8
    graphs = VerifyGraphs(max_buffer_bytes=int(1.5 * one_bucket))
    for method in ("token", "block", "token"):  # the third call captures token again
        gen = torch.Generator("cuda")
        eager = verify(method, tokens, q, p, gen.manual_seed(0), validate=False)
        graphed = verify(method, tokens, q, p, gen.manual_seed(0), validate=False, graphs=graphs)
        assert same_tokens(eager, graphed), method
        assert len(graphs) == 1 and graphs.buffer_bytes <= 1.5 * one_bucket
