"""CUDA graphs for verification (verification/graphs.py): replays give eager's tokens.

The graphed tests run on a CUDA device where one is present (scripts/gpu_checks.sh), else on
the fake device that captures and replays as CUDA does (tests/fake_graphs.py); on the CPU
graphs never apply, which the first tests check.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from fake_device import FakeCuda

from blockspec.verification import METHODS, VERIFIERS, VerifyGraphs, verify
from blockspec.verification import graphs as verify_graphs
from blockspec.verification.graphs import batch_bucket
from blockspec.verification.modification import ResidualRows
from tests.test_verify_cost import inputs, same_tokens


@pytest.fixture
def cuda():
    """A CUDA device: the machine's, or the fake one that captures graphs."""
    with contextlib.nullcontext() if torch.cuda.is_available() else FakeCuda(graphs=True):
        yield


def on_cuda(regime: str, b: int, k: int, gamma: int, vocab: int) -> list[torch.Tensor]:
    return [t.to("cuda") for t in inputs(regime, b, k, gamma, vocab)]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)  # drawn on the host, copied once


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


@pytest.mark.parametrize("method", METHODS)
def test_replays_give_the_eager_tokens_at_every_batch_size(cuda, method):
    """Batches 5, 3, 8 and 5 again: buckets 8, 4 and 8 (replayed); pad rows never leak."""
    k = 1 if VERIFIERS[method].single_path else 3
    graphs = VerifyGraphs()
    for step, (b, regime) in enumerate(
        [(5, "realistic"), (3, "agree"), (8, "disjoint"), (5, "agree")]
    ):
        tokens, q, p = on_cuda(regime, b, k, 6, vocab=500)
        eager = verify(method, tokens, q, p, seeded(step), validate=False)
        graphed = verify(method, tokens, q, p, seeded(step), validate=False, graphs=graphs)
        assert same_tokens(eager, graphed), (step, b)
    assert len(graphs) == 2 and graphs.eager_shapes == 0  # one graph per bucket


@pytest.mark.parametrize("method", [m for m in METHODS if VERIFIERS[m].modifies_target])
def test_replays_thread_the_same_carry(cuda, method):
    """Three steps of the same requests: the records each step leaves modify the next one."""
    k = 1 if VERIFIERS[method].single_path else 3
    graphs = VerifyGraphs()
    carry_eager = carry_graphed = None
    for step, regime in enumerate(["disjoint", "realistic", "disjoint"]):
        tokens, q, p = on_cuda(regime, 6, k, 5, vocab=300)
        eager = verify(method, tokens, q, p, seeded(step), carry=carry_eager)
        graphed = verify(method, tokens, q, p, seeded(step), carry=carry_graphed, graphs=graphs)
        assert same_tokens(eager, graphed), step
        carry_eager, carry_graphed = eager.carry, graphed.carry
        assert live_records(carry_eager) == live_records(carry_graphed), step


def live_records(carry) -> list[list[tuple]]:
    """Each request's live records (log p, log q, rows left), oldest first: a graphed call
    carries them among dead columns, at the bound's width from the first step."""
    fields = [t.cpu() for t in (carry.log_p, carry.log_q, carry.rows_left)]
    return [
        [record for record in zip(*(f[i].tolist() for f in fields), strict=True) if record[2] > 0]
        for i in range(len(fields[0]))
    ]


def test_buffers_beyond_the_byte_budget_evict_the_least_recently_used(cuda):
    tokens, q, p = on_cuda("realistic", 8, 1, 6, vocab=500)
    one_bucket = sum(t.numel() * t.element_size() for t in (tokens, q, p)) + 8 * 8 * 8
    graphs = VerifyGraphs(max_buffer_bytes=int(1.5 * one_bucket))
    for method in ("token", "block", "token"):  # the third call captures token again
        eager = verify(method, tokens, q, p, seeded(0), validate=False)
        graphed = verify(method, tokens, q, p, seeded(0), validate=False, graphs=graphs)
        assert same_tokens(eager, graphed), method
        assert len(graphs) == 1 and graphs.buffer_bytes <= 1.5 * one_bucket
