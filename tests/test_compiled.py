"""The decode step's forwards through torch.compile on the CPU (workers/compiled.py): inductor's
C++ backend with freezing, the weights packed by inductor. Each compile of the tiny pair takes
seconds; the module shares one compiled engine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_engine import make_engine, tiny_pair
from torch._dynamo.utils import counters

import blockspec.workers.compiled as compiled_module
from blockspec.service.requests import make_request
from blockspec.workers.compiled import CompiledForward
from blockspec.workers.llama import KVCache, Llama, LlamaSpec
from blockspec.workers.sampling import SamplingParams


@pytest.fixture(scope="module")
def engines():
    _, target, draft = tiny_pair(vocab=48)
    eager = make_engine(target, draft, max_batch=16)
    compiled = make_engine(target, draft, max_batch=16)
    compiled.draft.use_compiled()
    compiled.target.use_compiled()
    return eager, compiled


# Chains and multi-path trees together: each kind of call compiles once (about 10 s each here).
METHODS = [("block", 1, 3), ("gbv", 3, 2), ("token", 1, 2), ("spectr", 2, 3)]


def requests(engine, seed: int, sampling: SamplingParams, methods=METHODS) -> list:
    return [
        make_request(engine.limits, [5, 1 + i, 7, 3], 30, m, k, g, sampling, seed=seed + i)
        for i, (m, k, g) in enumerate(methods)
    ]


def test_a_request_alone_gets_the_eager_tokens(engines):
    """Seeded at T = 1, a multi-path request alone: the same tokens as the eager engine, in
    float32 (the compiled forwards sum in another order: their logits move in the last bits).
    Its kinds of call (the tree pass; the draft's pending run of one token or more; its
    proposal past the pending run) compile once each."""
    eager, compiled = engines
    alone = requests(eager, 9, SamplingParams(1.0), [("gbv", 2, 3)])
    graphs = counters["stats"]["unique_graphs"]
    assert compiled.generate(alone)[0].token_ids == eager.generate(alone)[0].token_ids
    assert counters["stats"]["unique_graphs"] > graphs  # compiled, not eager


def test_the_drafts_proposal_is_one_compiled_call_a_step(engines, monkeypatch):
    """Past its pending run (one compiled forward), the draft's γ depths of forward, head,
    law and draw run as one compiled call (CompiledCalls), not a compiled forward each."""
    _, compiled = engines
    draft = compiled.draft
    forwards, proposals = [], []
    monkeypatch.setattr(draft.forward, "_compiled", counting(draft.forward._compiled, forwards))
    monkeypatch.setattr(draft.proposals, "run", counting(draft.proposals.run, proposals))
    alone = requests(compiled, 4, SamplingParams(1.0), [("gbv", 2, 3)])
    steps = compiled.generate(alone)[0].stats.target_calls
    assert len(forwards) == len(proposals) == steps


def counting(fn, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return counted


def test_compiled_forwards_replay_inside_the_decode_graphs(engines, monkeypatch):
    """How CUDA runs them (`use_graphs(compiled=True)`: inductor's kernels captured in the
    decode graphs), the graphs emulated on the CPU: the padded batch, the bucketed window and
    the draft's proposal call the compiled forward, and a request alone gets the eager tokens.
    The CPU's GEMM autotuning, which CUDA does not run, is off here (it triples the compile)."""
    monkeypatch.setattr(compiled_module, "INDUCTOR", {"freezing": True, "cpp_wrapper": True})
    eager, _ = engines
    graphed = make_engine(eager.target.model, eager.draft.model, max_batch=16)
    graphed.draft.use_graphs(emulate=True, compiled=True)
    graphed.target.use_graphs(emulate=True, compiled=True)
    calls = []
    for worker in (graphed.draft, graphed.target):
        assert worker.forward.captured is not worker.model
        worker.forward.captured = counting(worker.forward.captured, calls)
    alone = requests(eager, 9, SamplingParams(1.0), [("gbv", 2, 3)])
    assert graphed.generate(alone)[0].token_ids == eager.generate(alone)[0].token_ids
    assert graphed.target.forward.replays and graphed.draft.proposals.replays and calls


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_batch_of_every_kind_gets_the_eager_tokens(engines, temperature):
    """Seeded, chains and multi-path trees in one batch as it shrinks from 8 to 1: the same
    tokens as the eager engine (~3 minutes of compiles)."""
    eager, compiled = engines
    sampling = SamplingParams(temperature)
    want = [r.token_ids for r in eager.generate(requests(eager, 3, sampling, METHODS * 2))]
    got = compiled.generate(requests(eager, 3, sampling, METHODS * 2))
    assert [r.token_ids for r in got] == want


def test_after_a_warm_up_of_one_and_two_requests_larger_batches_compile_nothing(engines):
    """The warm-up of compiled forwards without graphs runs batches of 1 and 2 requests only
    (warm_up._compiled_sizes): dynamo keeps one graph for every size above 1, so a batch of 3
    or 5 then compiles nothing, and still gets the eager tokens."""
    from blockspec.service.warm_up import warm_up

    eager, compiled = engines
    shape, sampling = ("block", 1, 3), SamplingParams(1.0)
    report = warm_up(compiled, [shape], [sampling], max_context=64, compiles=True)
    assert report.runs == 2 * 2  # `none` and the shape, at 1 and 2 requests
    graphs = counters["stats"]["unique_graphs"]
    for n in (3, 5):
        batch = requests(eager, 40 + n, sampling, [shape, ("none", 1, 1)] * n)[:n]
        want = [r.token_ids for r in eager.generate(batch)]
        assert [r.token_ids for r in compiled.generate(batch)] == want
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_step_calls_the_compiled_forward_and_another_cache_runs_eagerly(engines, monkeypatch):
    _, compiled = engines
    forward = compiled.target.forward
    assert isinstance(forward, CompiledForward)
    assert isinstance(compiled.draft.forward, CompiledForward)
    model = forward.model
    other = KVCache(model.spec, model.kv_heads, 2, 16, torch.float32, "cpu")
    tokens = torch.zeros(2, 1, 1, dtype=torch.int64)
    mask = torch.ones(2, 1, 1, 1, dtype=torch.bool)
    calls = []
    monkeypatch.setattr(forward, "_compiled", lambda *args: calls.append(args))
    logits = forward(tokens, tokens, other, mask)[0]
    assert not calls and logits.shape == (2, 1, 1, 48)
    forward(tokens, tokens, forward.cache, mask)
    assert len(calls) == 1


def test_the_actors_compile_their_forwards_when_asked(monkeypatch):
    """ReplicaConfig.compiled reaches the actors as DecodeForwards (through ActorSpec): the
    draft actor's and an unsplit target shard's decode forwards go through torch.compile, over
    dense weights; a split shard's stay eager (its forward all-reduces); off by default."""
    from blockspec.service.config import ReplicaConfig
    from blockspec.workers import actors
    from blockspec.workers.compiled import CompiledCalls, DecodeForwards
    from blockspec.workers.llama import Linear
    from blockspec.workers.models import TINY_DRAFT, TINY_TARGET
    from blockspec.workers.tensor_parallel import TargetShard

    assert not ReplicaConfig().compiled and ReplicaConfig(compiled=True).compiled
    monkeypatch.setattr(actors, "use_numpy_wire", lambda: None)  # Ray's serializer: not here
    forwards = DecodeForwards(compiled=True)
    draft = actors.DraftActor.__ray_metadata__.modified_class(
        str(TINY_DRAFT), 2, 64, "float32", "cpu", 1, forwards=forwards
    )
    target = actors.TargetShardActor.__ray_metadata__.modified_class(
        str(TINY_TARGET), 0, 1, 2, 64, "float32", "cpu", 1, forwards
    )
    assert isinstance(draft.worker.forward, CompiledForward)
    assert isinstance(draft.worker.proposals, CompiledCalls)
    assert isinstance(target.shard.worker.forward, CompiledForward)
    layers = [m for m in target.shard.worker.model.modules() if isinstance(m, Linear)]
    assert layers and not any(m.packed for m in layers)
    split = TargetShard(TINY_TARGET, 0, 2, 2, 64, forwards=forwards).worker
    assert not isinstance(split.forward, CompiledForward)


def test_compiled_forwards_refuse_packed_weights():
    hf, _, _ = tiny_pair(vocab=48)
    model = Llama(LlamaSpec.from_hf_config(hf.config), hf.state_dict(), packed=True)
    cache = KVCache(model.spec, model.kv_heads, 1, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="dense weights"):
        CompiledForward(model, cache)


def test_each_model_gets_graphs_of_its_own():
    """A compiled forward keeps no guard on its model's modules (compiled._compile), so each has
    a code object of its own for dynamo to keep its graphs on: two models of one shape and
    other weights, compiled in one process, each give their own eager logits. With one code
    object (the mutant: Llama.forward's, every model's), the second model's call replays the
    first one's graph, whose frozen weights are the first model's."""
    hf, _, _ = tiny_pair(vocab=48)
    spec = LlamaSpec.from_hf_config(hf.config)
    state = hf.state_dict()
    states = [{k: v * scale for k, v in state.items()} for scale in (1.0, 0.5)]
    tokens = torch.tensor([[[3, 1, 4]]])
    positions = torch.arange(3).view(1, 1, 3)
    mask = torch.ones(3, 3, dtype=torch.bool).tril().view(1, 1, 3, 3)
    for weights in states:
        model = Llama(spec, weights)
        cache = KVCache(spec, model.kv_heads, 1, 16, torch.float32, "cpu")
        want = model(tokens, positions, cache, mask)[0]
        compiled = compiled_module.compile_forward(Llama(spec, weights, packed=False))
        got = compiled(tokens, positions, cache, mask, window=8)[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_workers_import_without_dynamo():
    """An actor restarted after a loss imports the workers, then takes its weights from the
    object store (not through transformers, which imports dynamo): torch._inductor, and dynamo
    with it, must stay out of that import, which only compiled forwards need (~1 s of each
    restart; docs/reliability.md)."""
    modules = ("torch._dynamo", "torch._inductor")
    code = (
        f"import sys, blockspec.workers.actors; print([m for m in {modules} if m in sys.modules])"
    )
    run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert run.stdout.strip() == "[]"
