"""CUDA graphs captured and replayed on the fake device (tests/fake_graphs.py), as on a GPU.

The graph path's failures are a GPU's: a capture that reads the host, a graph whose outputs sit
in memory another graph writes, a capture per batch size while serving. Here they fail on the
CPU: the harness records each capture's ops and replays them on the same memory, hands a
pool's free blocks to the next capture into it, and refuses what a capture refuses. So:

- the harness itself does what CUDA does (replays rewrite the same storage, Python does not
  re-run, host reads and copies from the host refuse, a pool's memory is reused);
- a later graph's outputs held across an earlier graph's replay keep their values, with the
  pool shared, after an eviction and recapture too; a mutant whose outputs stay in the pool
  (the code before) fails both;
- 3 and 4 requests replay one graph, so nothing captures after warm-up; a mutant that keys the
  forward's graphs by batch size captures again;
- the engine decodes with every graph on (the forwards, the proposal, the tree, the verify
  calls) and gives the CPU engine's seeded tokens: every method, mixed batches, a session, a
  feature draft, the speculation cache; no capture fails, and a step syncs the host once.
"""

from __future__ import annotations

import pytest
import torch
from fake_device import FakeCuda, is_fake, to_fake_model
from test_engine import make_engine, tiny_pair
from test_fake_device import (
    HOST_SYNCS_PER_STEP,
    MAX_BATCH,
    MAX_LEN,
    mutate,
    requests,
    run_cpu,
    run_fake,
)
from test_feature_draft import random_fc

import blockspec.workers.graphs as worker_graphs
from blockspec.service.build import build_engine
from blockspec.service.engine import SpeculativeEngine
from blockspec.service.policy import PLAIN
from blockspec.service.requests import make_request
from blockspec.verification import METHODS
from blockspec.verification import graphs as verify_graphs
from blockspec.verification.graphs import capture
from blockspec.workers.feature_draft import FeatureDraft
from blockspec.workers.graphs import CallGraphs, ForwardGraphs
from blockspec.workers.models import TINY_DRAFT, TINY_TARGET
from blockspec.workers.speculation import SpeculationCache, speculation_cache
from blockspec.workers.step import StepRunner, graph_caches
from blockspec.workers.target import TargetWorker

# The code before its outputs had memory of their own: a graph's outputs in the shared pool.
OUTPUTS_IN_THE_POOL = (
    """        for mine, scratch in zip(_leaves(own), _leaves(call()), strict=True):
            mine.copy_(scratch)""",
    """        own = call()""",
)
# Graphs keyed by the inputs' whole shapes, batch size included: 3 and 4 requests, two graphs.
KEYED_BY_BATCH_SIZE = (
    "shapes = tuple((t.shape[1:], t.dtype) for t in batch)",
    "shapes = tuple((t.shape, t.dtype) for t in batch)",
)


def address(t: torch.Tensor) -> int:
    """Where a fake-device tensor's memory is (its CPU storage's)."""
    return t.elem.untyped_storage().data_ptr()


def test_a_fake_capture_replays_its_kernels_on_the_same_memory():
    with FakeCuda(graphs=True) as dev, torch.inference_mode():
        assert torch.cuda.is_available() and worker_graphs.graphs_available("cuda")
        x = torch.arange(4.0, device="cuda")
        branch = []

        def call():
            branch.append(1)  # Python: runs at the warm-up and the capture, never at a replay
            y = x * 2 + torch.tensor(1.0)  # a 0-dim host tensor: its value at capture
            return y[1:], y.sum(0, keepdim=True)

        graph, (tail, total) = capture(call, x.device)
        assert dev.captures == 1 and len(branch) == 2 and is_fake(tail)
        storage = address(tail)
        x.copy_(torch.ones(4, device="cuda"))
        dev.reset()
        graph.replay()
        assert tail.tolist() == [3.0, 3.0, 3.0] and total.tolist() == [12.0]
        assert address(tail) == storage and len(branch) == 2
        assert dev.kernels == {"graph": 1}
    assert not torch.cuda.is_available()  # restored


@pytest.mark.parametrize(
    "what, call",
    [
        ("item", lambda x: x.sum().item()),
        ("to host", lambda x: x.cpu()),
        ("nonzero", lambda x: x.nonzero()),
        ("mask index", lambda x: x[x > 1]),
        ("a copy from the host", lambda x: x + torch.ones(4).to("cuda", non_blocking=True)),
        ("a copy from the host", lambda x: torch.tensor([1.0, 2.0], device="cuda")),
        ("a host index tensor", lambda x: x[torch.tensor([0, 2])]),
    ],
)
def test_a_fake_capture_refuses_what_a_capture_refuses(what, call):
    with FakeCuda(graphs=True), torch.inference_mode():
        x = torch.arange(4.0, device="cuda")
        call(x)  # legal eagerly
        with pytest.raises(RuntimeError, match=f"capturing \\(fake device: {what}\\)"):
            capture(lambda: call(x), x.device)


def test_a_pool_hands_freed_memory_to_the_next_capture_into_it():
    with FakeCuda(graphs=True), torch.inference_mode():
        x = torch.arange(256.0, device="cuda")
        first, (out,) = capture(lambda: (x * 2 + 1,), x.device)  # x * 2 + 1 in the pool: freed
        pool = first.pool()
        scratch = {b.storage.data_ptr() for b in pool.blocks}
        assert address(out) not in scratch  # outputs: memory of their own

        def held_after_capture(pool_) -> int:
            with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=pool_):
                held = x - 1
            return address(held)

        assert held_after_capture(pool) in scratch  # the shared pool's freed block, reused
        assert held_after_capture(None) not in scratch  # a graph's own pool: fresh memory


def later_outputs_across_an_earlier_replay(graphs: CallGraphs) -> tuple[list, list]:
    """A graph captured after another, its outputs held (views) while the other replays."""
    x = torch.arange(64.0, device="cuda").view(1, 64)
    graphs.run(("earlier",), lambda t: (t * 2 + 1,), x)  # its t * 2 is scratch
    (held,) = graphs.run(("later",), lambda t: (t - 3,), x)
    graphs.run(("earlier",), lambda t: (t * 2 + 1,), x)
    return held.tolist(), (x - 3).tolist()


def test_a_later_graphs_outputs_survive_an_earlier_graphs_replay(monkeypatch):
    with FakeCuda(graphs=True), torch.inference_mode():
        held, expected = later_outputs_across_an_earlier_replay(CallGraphs(4, copies=False))
        assert held == expected
        mutate(monkeypatch, verify_graphs, "capture", *OUTPUTS_IN_THE_POOL, worker_graphs)
        held, expected = later_outputs_across_an_earlier_replay(CallGraphs(4, copies=False))
        assert held != expected  # the earlier graph's scratch ran over them


def steps_around_an_eviction(graphs: CallGraphs) -> list[bool]:
    """Steps that replay a then b and read both outputs at their end (views), before and after
    a is evicted and captured again into the pool the two share: each step's outputs right?"""
    x = torch.arange(64.0, device="cuda").view(1, 64)
    a = lambda t: (t + 1,)  # noqa: E731
    b = lambda t: (t * 3 - 1,)  # noqa: E731  (t * 3: scratch)

    def step() -> bool:
        (out_a,), (out_b,) = graphs.run(("a",), a, x), graphs.run(("b",), b, x)
        return out_a.tolist() == (x + 1).tolist() and out_b.tolist() == (x * 3 - 1).tolist()

    right = [step(), step()]
    graphs._graphs.popitem(last=False)  # a, the least recently used
    return [*right, step(), step()]


def test_outputs_survive_eviction_and_recapture_into_a_shared_pool(monkeypatch):
    with FakeCuda(graphs=True), torch.inference_mode():
        assert steps_around_an_eviction(CallGraphs(4, copies=False)) == [True] * 4
        mutate(monkeypatch, verify_graphs, "capture", *OUTPUTS_IN_THE_POOL, worker_graphs)
        # in the pool, safe while the graphs replay in their capture's order; a again is
        # captured after b, into b's scratch, which b's replay then runs over
        assert steps_around_an_eviction(CallGraphs(4, copies=False)) == [True, True, False, False]


def captures_after_warm_up(tiny_target) -> int:
    """Tree passes of 4 requests, then of 3, 4 and 3: the captures past the first."""
    model, cache = tiny_target
    forward = ForwardGraphs(model, cache, copies=False)
    warm = 0
    with FakeCuda(graphs=True) as dev, torch.inference_mode():
        for i, n in enumerate((4, 3, 4, 3)):
            tokens = torch.randint(0, 48, (n, 1, 3), device="cuda")
            positions = torch.arange(3, device="cuda").expand(n, 1, 3)
            mask = torch.ones(n, 1, 3, 3, dtype=torch.bool, device="cuda").tril()
            forward(tokens, positions, cache, mask)
            warm = dev.captures if i == 0 else warm
    assert forward.replays == 4
    return dev.captures - warm


@pytest.fixture
def tiny_target():
    with FakeCuda(graphs=True):
        model = to_fake_model(tiny_pair(vocab=48)[1])
        worker = TargetWorker(model, MAX_BATCH, MAX_LEN, device="cuda")
    return worker.model, worker.cache


def test_three_and_four_requests_capture_nothing_after_warm_up(tiny_target, monkeypatch):
    assert captures_after_warm_up(tiny_target) == 0
    mutate(monkeypatch, ForwardGraphs, "_own", *KEYED_BY_BATCH_SIZE)
    assert captures_after_warm_up(tiny_target) > 0


# ------------------------------------------------------------------------------ the engine
def graphed_run(engine, reqs) -> tuple[list, list[int], int]:
    """Each request's tokens and cached prompt tokens, the host syncs of each step and the
    captures, with every graph on (on the fake device that captures)."""
    dev = FakeCuda(graphs=True)
    out, per_step, _ = run_fake(engine, reqs, dev)
    return out, per_step, dev.captures


def all_graphs(engine) -> list:
    """The draft's forwards and proposals, the target's forwards, the tree's and verifiers'."""
    return graph_caches(engine.draft, engine.target)


@pytest.fixture(scope="module")
def graphed():
    """The tiny pair on the CPU, and on the fake device with every graph on."""
    common = dict(max_batch=MAX_BATCH, max_len=MAX_LEN, max_sessions=1, packed=False)
    cpu, _ = build_engine(str(TINY_DRAFT), str(TINY_TARGET), **common)
    with FakeCuda(graphs=True):
        fake, _ = build_engine(str(TINY_DRAFT), str(TINY_TARGET), device="cuda", **common)
    assert isinstance(fake.target.forward, ForwardGraphs)
    assert isinstance(fake.draft.proposals, CallGraphs)
    return cpu, fake


def check_graphed(engine, expected: list, reqs: list) -> int:
    """Asserts the graphed run's tokens, syncs and graphs; returns its captures."""
    out, per_step, captures = graphed_run(engine, reqs)
    assert out == expected
    assert max(per_step) <= HOST_SYNCS_PER_STEP, per_step
    caches = all_graphs(engine)
    assert all(c.eager_shapes == 0 for c in caches), [c.eager_shapes for c in caches]
    drafted = any(r.method != PLAIN for r in reqs)
    assert caches[2].replays > 0 and (caches[1].replays > 0 or not drafted)
    return captures


@pytest.mark.parametrize("method", [PLAIN, *METHODS])
def test_every_method_decodes_from_graphs_as_on_the_cpu(graphed, method):
    cpu, fake = graphed
    methods = [method] * 3
    check_graphed(fake, run_cpu(cpu, requests(methods)), requests(methods))


def test_a_mixed_batch_decodes_from_graphs_as_on_the_cpu(graphed):
    """...and its shapes, met again, capture nothing (the batch shrinks as requests end)."""
    cpu, fake = graphed
    methods = ["block", "spectr_gbv", PLAIN, "traversal"]
    expected = run_cpu(cpu, requests(methods))
    check_graphed(fake, expected, requests(methods))
    assert check_graphed(fake, expected, requests(methods)) == 0


def test_a_session_follow_up_decodes_from_graphs_as_on_the_cpu(graphed):
    cpu, fake = graphed

    def session(engine, run) -> list:
        first = make_request(
            engine.limits, [3, 1, 4, 1, 5], 8, "greedy_block", 1, 3, seed=1, session_id="s"
        )
        ((out, _),) = run(engine, [first])
        follow = make_request(
            engine.limits, [*first.prompt_ids, *out, 9, 2], 8, "gbv", 3, 3, seed=2, session_id="s"
        )
        return [out, *run(engine, [follow])]

    expected = session(cpu, run_cpu)
    assert expected[1][1] > 5  # cached
    assert session(fake, lambda engine, reqs: graphed_run(engine, reqs)[0]) == expected


@pytest.mark.parametrize("speculation", [0, 4])
def test_a_feature_draft_decodes_from_graphs_as_on_the_cpu(speculation):
    """A feature draft (it reads the target's features), alone and with the speculation cache
    preparing the next step's proposals (its forks run eagerly beside the graphs)."""
    _, target, draft = tiny_pair(vocab=48, draft_fc=random_fc(64, scale=0.1))
    methods = ["block", "gbv", "greedy_block", "token"]
    spec = SpeculationCache(speculation) if speculation else None
    cpu = make_engine(target, draft, MAX_BATCH, MAX_LEN, speculation=spec)
    with FakeCuda(graphs=True):
        slots = MAX_BATCH
        proposer = FeatureDraft(to_fake_model(draft), slots, MAX_LEN, device="cuda")
        worker = TargetWorker(to_fake_model(target), slots, MAX_LEN, device="cuda")
        proposer.use_graphs()
        worker.use_graphs()
        fake = SpeculativeEngine(
            StepRunner(worker, proposer, speculation_cache(proposer, speculation)),
            MAX_BATCH,
            MAX_LEN,
            target.spec.vocab_size,
        )
    expected = run_cpu(cpu, requests(methods))
    assert graphed_run(fake, requests(methods))[0] == expected
    assert all(c.eager_shapes == 0 for c in all_graphs(fake))
