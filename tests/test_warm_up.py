"""Warm-up (service/warm_up.py) on the fake device that captures graphs (tests/fake_graphs.py):
every graph a deployment's declared shapes meet is captured before it serves, nothing captures
while it serves, and a capture that fails is an error at start.

- after warm-up for two shapes, a stream of their requests (alone, mixed, batches of 1 to 4,
  T = 1 and greedy) captures nothing and runs nothing eagerly, with the CPU engine's tokens;
- a shape not declared runs eagerly (counted), still with the CPU's tokens, and captures
  nothing;
- a host read inside a graphed call fails the warm-up naming the cache (served without a
  warm-up, the same engine only warns and runs that call eagerly);
- graphs that outgrow a cache's bounds fail the warm-up (they would recapture while serving);
- through the Ray actors' classes (in process, messages through the wire) the coordinator's
  warm-up reaches the draft's and rank 0's graphs alike;
- a replica warms its default shape and auto arms, or the `graph_shapes` it names.
"""

from __future__ import annotations

import pytest
from fake_device import FakeCuda
from test_fake_device import MAX_BATCH, MAX_LEN, run_cpu, wired_engine

from blockspec.service.build import build_engine
from blockspec.service.policy import PLAIN
from blockspec.service.requests import GenerationRequest, make_request
from blockspec.service.warm_up import warm_up
from blockspec.workers.draft import DraftProposer
from blockspec.workers.models import TINY_DRAFT, TINY_TARGET
from blockspec.workers.sampling import SamplingParams
from blockspec.workers.step import VERIFY_GRAPHS, graph_caches
from blockspec.workers.tree import TREE_GRAPHS

SHAPES = [("block", 1, 3), ("gbv", 2, 2)]
SAMPLINGS = [SamplingParams(1.0), SamplingParams(0.0)]
COMMON = dict(max_batch=MAX_BATCH, max_len=MAX_LEN, packed=False)


@pytest.fixture
def engines():
    """The tiny pair on the CPU and on the fake device with graphs; the process's tree and
    verify graphs emptied first (other tests' graphs fill their bounds), left unsealed."""
    for cache in (TREE_GRAPHS, VERIFY_GRAPHS):
        cache._graphs.clear()
    cpu, _ = build_engine(str(TINY_DRAFT), str(TINY_TARGET), **COMMON)
    with FakeCuda(graphs=True):
        fake, _ = build_engine(str(TINY_DRAFT), str(TINY_TARGET), device="cuda", **COMMON)
    yield cpu, fake
    for cache in (TREE_GRAPHS, VERIFY_GRAPHS):
        cache.sealed, cache.strict = False, False


def served(engine, reqs: list[list[GenerationRequest]]) -> tuple[list, int, int]:
    """Each request's tokens and cached prompt tokens (the batches one after another), the
    captures and the calls run eagerly."""
    caches = graph_caches(engine.draft, engine.target)
    eager = sum(c.eager_calls for c in caches)
    out = []
    with FakeCuda(graphs=True) as dev:
        for batch in reqs:
            out += [(r.token_ids, r.cached_tokens) for r in engine.generate(list(batch))]
    return out, dev.captures, sum(c.eager_calls for c in caches) - eager


def batches(engine, shape_of) -> list[list[GenerationRequest]]:
    """Batches of 1 to 4 requests, prompts of 3 to 30 tokens, T = 1 and greedy alternating;
    request i's (method, K, γ): shape_of(i)."""
    out, i = [], 0
    for size in (1, 4, 2, 3, 4, 1):
        batch = []
        for _ in range(size):
            method, k, gamma = shape_of(i)
            prompt = [(5 * i + j) % 48 for j in range(3 + 9 * (i % 4))]
            sampling = SAMPLINGS[i % 2]
            batch.append(
                make_request(engine.limits, prompt, 12, method, k, gamma, sampling, seed=i)
            )
            i += 1
        out.append(batch)
    return out


def test_after_warm_up_the_declared_shapes_capture_nothing(engines):
    cpu, fake = engines
    assert warm_up(cpu, SHAPES).graphs == 0  # no graphs on a CPU: nothing to do
    with FakeCuda(graphs=True) as dev:
        report = warm_up(fake, SHAPES, SAMPLINGS)
    assert report.graphs == dev.captures > 0 and report.runs > 0
    assert all(c.sealed and not c.strict for c in graph_caches(fake.draft, fake.target))
    declared = batches(fake, lambda i: SHAPES[i % 2] if i % 3 else (PLAIN, None, None))
    out, captures, eager = served(fake, declared)
    assert (captures, eager) == (0, 0)
    assert out == [res for batch in declared for res in run_cpu(cpu, batch)]
    other = [[make_request(fake.limits, [1, 2, 3], 8, "token", 1, 5, seed=3)]]
    out, captures, eager = served(fake, other)
    assert captures == 0 and eager > 0
    assert out == run_cpu(cpu, other[0])


def test_through_the_actors_the_warm_up_reaches_their_graphs(engines):
    """The draft actor's and the target's rank 0's graphs (their classes in process, every
    message through the wire), driven from the coordinator's engine: after warm-up its
    declared batches capture nothing, run nothing eagerly and give the CPU's tokens."""
    cpu, _ = engines
    actors = wired_engine(graphs=True)
    with FakeCuda(graphs=True):
        report = warm_up(actors, SHAPES, SAMPLINGS)
    counts = actors.executor.graphs()
    # the draft's forwards, proposals, tree and verify graphs; rank 0's forwards, tree, verify
    assert report.graphs > 0 and len(counts) == 4 + 3
    declared = batches(actors, lambda i: SHAPES[i % 2] if i % 3 else (PLAIN, None, None))
    out, captures, _ = served(actors, declared)
    eager = sum(c.eager_calls for c in actors.executor.graphs())
    assert (captures, eager) == (0, sum(c.eager_calls for c in counts))
    assert out == [res for batch in declared for res in run_cpu(cpu, batch)]


def test_a_capture_that_fails_fails_the_warm_up(engines, monkeypatch):
    _, fake = engines
    law = DraftProposer._law

    def reads_the_host(self, logits, law_):
        logits.sum().item()  # a host read inside the proposal's graph
        return law(self, logits, law_)

    monkeypatch.setattr(DraftProposer, "_law", reads_the_host)
    with FakeCuda(graphs=True), pytest.raises(RuntimeError, match="CallGraphs: capture failed"):
        warm_up(fake, SHAPES)
    fake.draft.proposals._graphs.clear()
    batch = batches(fake, lambda i: SHAPES[0])[1]
    with FakeCuda(graphs=True):
        fake.generate(batch)  # serving without a warm-up: warned, and eager
    assert fake.draft.proposals.eager_shapes > 0


def test_graphs_beyond_a_caches_bounds_fail_the_warm_up(engines):
    _, fake = engines
    fake.target.forward.max_graphs = 1
    with FakeCuda(graphs=True), pytest.raises(RuntimeError, match="need more than its bounds"):
        warm_up(fake, SHAPES)


def test_warm_up_prompts_reach_every_window(monkeypatch):
    """With windows narrowed to 16 positions, prompts of one window each: 4, 18, 34, 66."""
    from blockspec.service import warm_up as module
    from blockspec.workers import graphs

    monkeypatch.setattr(graphs, "MIN_WINDOW", 16)
    lengths = module._prompt_lengths(96)
    assert lengths == [4, 18, 34, 66]
    assert [graphs.window_bucket(n, 96) for n in lengths] == [16, 32, 64, 96]
    assert max(lengths) + module.STEPS_PER_RUN * (4 + 1) <= 96  # γ = 4 stays within it


def test_a_replica_warms_its_default_auto_and_named_shapes():
    """ReplicaConfig.warm_shapes: the default method at K = 1 and the default γ, the auto
    arms, and `graph_shapes` instead of the default where given (carrying methods too, which
    auto cannot switch to); a shape that is malformed, unknown, or past max_k / max_gamma is
    refused naming the field."""
    from blockspec.service.config import ReplicaConfig

    config = ReplicaConfig(default_method="token", default_gamma=5, auto_arms=["gbv/2/3"])
    assert config.warm_shapes() == [("gbv", 2, 3), ("token", 1, 5)]
    named = ReplicaConfig(graph_shapes=["greedy_block/1/3"], auto_arms=["none"])
    assert named.warm_shapes() == [("greedy_block", 1, 3)]
    for bad, why in [
        ("gbv/9/4", "exceeds max_k"),
        ("token/2/3", "K = 1 for token"),
        ("foo/1/2", "unknown method"),
        ("block-1-2", "is not 'method/K/γ'"),
    ]:
        with pytest.raises(ValueError, match=f"graph_shapes: '{bad}'.*{why}"):
            ReplicaConfig(graph_shapes=[bad])
