"""The decode path's GPU machinery, on the CPU: forwards replayed from static buffers
(workers/graphs.py), and the fused kernels a CUDA forward runs (workers/llama.fused_kernels).

``emulate=True`` runs what a CUDA graph would (the padded batch, the bucketed prefix window, the
static input buffers refilled each call, the outputs copied out of buffers the next replay
overwrites) without capturing, so a wrong pad, a stale buffer or a window too narrow shows here;
the capture itself needs a GPU (blockspec-bench engine-gpu runs the engine with and without
graphs there, greedy parity included). The windows are narrowed to 8 positions so that a
generation crosses several of them.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import MIXED, make_engine, tiny_pair

import blockspec.workers.draft as draft_module
import blockspec.workers.graphs as graphs
import blockspec.workers.llama as llama
from blockspec.service.requests import make_request
from blockspec.workers.graphs import ForwardGraphs, batch_bucket, window_bucket
from blockspec.workers.llama import KVCache
from blockspec.workers.sampling import SamplingParams
from blockspec.workers.token_draft import TokenDraft


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=48)


@pytest.fixture
def narrow(monkeypatch):
    monkeypatch.setattr(graphs, "MIN_WINDOW", 8)


def test_buckets():
    assert [window_bucket(n, 1024) for n in (0, 1, 256, 257, 900, 1024)] == [256] * 3 + [
        512,
        1024,
        1024,
    ]
    assert window_bucket(300, 400) == 400
    assert [batch_bucket(b, 16) for b in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert batch_bucket(5, 6) == 5  # no slots to pad into


def committed_cache(model, lengths: list[int], slots: int = 6, seed: int = 0) -> KVCache:
    """A cache whose first slots hold random contexts of these lengths (the rest stale)."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(model.spec, model.kv_heads, slots, 64, torch.float32, "cpu")
    cache.k.normal_(generator=gen)  # stale entries past every length: must stay unseen
    cache.v.normal_(generator=gen)
    tokens = torch.randint(0, 48, (slots, 1, max(lengths)), generator=gen)
    steps = torch.arange(max(lengths))
    mask = (steps[:, None] >= steps[None, :])[None, None].expand(slots, 1, -1, -1)
    feats = None if model.feature_fc is None else torch.randn(slots, 1, max(lengths), 64)
    _, k, v, _ = model(tokens, steps.expand(slots, 1, -1), cache, mask, features=feats, head=False)
    counts = torch.tensor(lengths + [0] * (slots - len(lengths)))
    cache.append(k[:, :, 0], v[:, :, 0], steps.expand(slots, -1), counts)
    return cache


def tree_inputs(n: int, nodes: int, cache: KVCache, seed: int):
    """A random tree pass: tokens, positions, an ancestor mask (each node sees itself and a
    random subset of the earlier nodes)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 48, (n, 1, nodes), generator=gen)
    depth = torch.randint(0, 3, (n, nodes), generator=gen)
    positions = (cache.lengths[:n, None] + depth)[:, None]
    seen = torch.rand(n, nodes, nodes, generator=gen) < 0.5
    mask = (seen.tril(-1) | torch.eye(nodes, dtype=torch.bool))[:, None]
    return tokens, positions, mask


def assert_same(replayed, eager):
    for a, b in zip(replayed, eager, strict=True):
        if b is None:
            assert a is None
        else:
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # summation order


def test_a_replayed_tree_pass_equals_the_eager_one_call_after_call(pair, narrow):
    _, target, _ = pair
    cache = committed_cache(target, [5, 9, 2])
    forward = ForwardGraphs(target, cache, emulate=True)
    for seed in range(3):  # the same shape: one graph, its buffers refilled each call
        inputs = tree_inputs(3, 7, cache, seed)
        assert_same(forward(*inputs[:2], cache, inputs[2]), target(*inputs[:2], cache, inputs[2]))
    assert len(forward) == 1 and forward.replays == 3
    # the cache grows past the window (16): a new graph (window 32), same outputs
    cache.lengths[1] = 20
    cache._host_lengths = None
    inputs = tree_inputs(3, 7, cache, 9)
    assert_same(forward(*inputs[:2], cache, inputs[2]), target(*inputs[:2], cache, inputs[2]))
    assert len(forward) == 2


def test_batches_of_one_bucket_replay_one_graph_and_a_shrink_blanks_the_rows_left(pair, narrow):
    """3 and 4 requests (bucket 4) share a graph: under continuous batching the batch moves
    within a bucket every step, and a graph per size would capture (a device sync) each time."""
    _, target, _ = pair
    cache = committed_cache(target, [5, 9, 2, 7])
    forward = ForwardGraphs(target, cache, emulate=True)
    for n in (3, 4, 3):
        inputs = tree_inputs(n, 7, cache, n)
        assert_same(forward(*inputs[:2], cache, inputs[2]), target(*inputs[:2], cache, inputs[2]))
    assert len(forward) == 1 and forward.replays == 3
    (entry,) = forward._graphs.values()
    tokens, positions, mask = entry.inputs
    # the 4th request's row of the second call is a pad row again: token 0 at position 0,
    # seeing every new token
    assert not tokens[3:].any() and not positions[3:].any() and mask[3:].all()
    assert torch.equal(tokens[:3], tree_inputs(3, 7, cache, 3)[0])


def test_graphs_beyond_the_memory_bound_are_dropped_least_recent_first(pair, narrow):
    _, target, _ = pair
    cache = committed_cache(target, [5, 9, 2])
    forward = ForwardGraphs(target, cache, emulate=True)
    for nodes in (3, 4):
        inputs = tree_inputs(3, nodes, cache, nodes)
        forward(*inputs[:2], cache, inputs[2])
    one = forward.buffer_bytes // 2  # about one graph's buffers
    forward.max_buffer_bytes = int(one * 1.5)
    inputs = tree_inputs(3, 5, cache, 5)
    replayed = forward(*inputs[:2], cache, inputs[2])
    assert len(forward) == 1  # both older graphs dropped: each alone fits, not two
    assert_same(replayed, target(*inputs[:2], cache, inputs[2]))
    assert [key[-1][0][0][1] for key in forward._graphs] == [5]  # the newest stays


def test_a_replayed_draft_depth_with_suffix_and_features_equals_the_eager_one(narrow):
    _, _, draft = tiny_pair(vocab=48, draft_fc=torch.randn(64, 128) * 0.1)
    cache = committed_cache(draft, [4, 7, 1, 3, 6])  # 5 requests: padded to 8 > 6 slots: 5
    forward = ForwardGraphs(draft, cache, emulate=True)
    gen = torch.Generator().manual_seed(1)
    n, k, s = 5, 3, 2
    shape = (draft.spec.num_layers, n, k, draft.kv_heads, s, draft.spec.head_dim)
    suffix = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    tokens = torch.randint(0, 48, (n, k, 1), generator=gen)
    positions = (cache.lengths[:n] + s)[:, None, None].expand(n, k, 1)
    features = torch.randn(n, k, 1, 64, generator=gen)
    ones = torch.ones(n, k, 1, 1, dtype=torch.bool)
    args = (tokens, positions, cache, ones, suffix)
    replayed = forward(*args, features=features, head=False)
    assert_same(replayed, draft(*args, features=features, head=False))
    assert forward.replays == 1
    # another cache (a speculation fork's) runs eagerly
    other = committed_cache(draft, [4, 7, 1, 3, 6])
    forward(tokens, positions, other, ones, suffix, features=features, head=False)
    assert forward.replays == 1 and len(forward) == 1


def requests(engine, seed: int, sampling: SamplingParams, new: int = 40):
    return [
        make_request(engine.limits, [5, 1 + i, 7, 3], new, m, k, g, sampling, seed=seed + i)
        for i, (m, k, g) in enumerate(MIXED)
    ]


@pytest.mark.parametrize(
    "feature, temperature, buckets",
    [(False, 1.0, True), (False, 0.0, True), (True, 0.0, True), (True, 1.0, False)],
    ids=["token-draft", "token-draft-greedy", "feature-draft-greedy", "feature-draft-exact"],
)
def test_the_engine_writes_the_same_tokens_with_replayed_forwards(
    feature, temperature, buckets, narrow, monkeypatch
):
    """Seeded, mixing every method, K and γ in one batch (and alone): the same tokens with the
    decode forwards replayed (batch buckets from 16 down to 1 as requests finish, windows from
    8 to 64 positions) as eagerly.

    Why the feature draft at T = 1 replays exact shapes (the batch unpadded, the window the
    longest length, the pending run as wide as its tokens): there a carried record
    (greedy_block, spectr_gbv) meets residuals of nearly no mass (the tiny feature draft is
    close to its target), whose normalised rows the last bits of p and q decide, so a wider
    window's summation order changes which token a seed draws (the law is the same). Exact
    shapes then compute bit for bit what the eager forwards do, which checks the replays'
    features and buffers exactly."""
    if not buckets:
        monkeypatch.setattr(graphs, "batch_bucket", lambda batch, slots: batch)
        monkeypatch.setattr(graphs, "window_bucket", lambda length, max_len: max(length, 1))
        monkeypatch.setattr(draft_module, "GRAPHED_PENDING", 1)
    # one model whatever ran before: its batch passes through every bucket as requests end
    seeded = torch.Generator().manual_seed(0)
    fc = torch.randn(64, 128, generator=seeded) * 0.1 if feature else None
    _, target, draft = tiny_pair(vocab=48, draft_fc=fc)
    sampling = SamplingParams(temperature)
    eager = make_engine(target, draft, max_batch=16)
    replayed = make_engine(target, draft, max_batch=16)
    replayed.draft.use_graphs(emulate=True)
    replayed.target.use_graphs(emulate=True)
    for seed in (0, 50):
        want = [r.token_ids for r in eager.generate(requests(eager, seed, sampling))]
        assert [r.token_ids for r in replayed.generate(requests(eager, seed, sampling))] == want
    alone = requests(eager, 7, sampling)[5]
    assert replayed.generate([alone])[0].token_ids == eager.generate([alone])[0].token_ids
    draft_graphs, target_graphs = replayed.draft.forward, replayed.target.forward
    proposals = replayed.draft.proposals
    assert draft_graphs.replays > 0 and target_graphs.replays > 0 and proposals.replays > 0
    if buckets:
        windows = {key[1] for key in target_graphs._graphs}
        assert {8, 16, 32} <= windows, windows
        assert {16, 8, 4, 1} <= {key[1] for key in proposals._graphs}  # batch buckets


def test_a_call_graph_pads_with_row_zero_and_hands_out_copies():
    """CallGraphs (the draft's proposal, emulated): the batch padded to its bucket with copies
    of row 0 (valid inputs for whatever the call reads), None outputs kept, copies handed out
    (changing one leaves the next replay's as they were), one graph per key and shape, and no
    bucket past the cache's slots."""
    buckets = []

    def call(x, y):  # x [n, 3], y [n]
        buckets.append(x.shape[0])
        if buckets == [4]:  # the capture: its pad row is row 0 (later calls leave it)
            assert torch.equal(x[3], x[0])
        return x * y[:, None], None, x.sum(1)

    graphs_ = graphs.CallGraphs(slots=8, emulate=True)
    x, y = torch.arange(9.0).view(3, 3), torch.tensor([1.0, 2.0, 3.0])
    out = graphs_.run(("a",), call, x, y)
    assert out[1] is None and torch.equal(out[0], x * y[:, None]) and torch.equal(out[2], x.sum(1))
    assert set(buckets) == {4}
    out[0].add_(1)
    again = graphs_.run(("a",), call, x + 1, y)
    assert torch.equal(again[0], (x + 1) * y[:, None])
    assert graphs_.replays == 2 and len(graphs_) == 1
    graphs_.run(("b",), call, x, y)
    assert len(graphs_) == 2
    buckets.clear()
    graphs.CallGraphs(slots=3, emulate=True).run(("a",), call, x, y)
    assert set(buckets) == {3}  # no slot to pad into


def test_a_replayed_proposal_equals_the_eager_one(pair, narrow):
    """The draft's whole proposal past its root from one graph (DraftProposer._paths): the
    eager proposal's tokens, rows and path keys/values, with 3 requests in a bucket of 4
    under mixed sampling settings, call after call as the caches grow."""
    _, _, model = pair
    eager, replayed = TokenDraft(model, 6, 64), TokenDraft(model, 6, 64)
    replayed.use_graphs(emulate=True)
    gen = torch.Generator().manual_seed(3)
    contexts = [torch.randint(0, 48, (length,), generator=gen) for length in (5, 9, 2)]
    params = [SamplingParams(), SamplingParams(0.7, 5), SamplingParams(0.0)]
    for d in (eager, replayed):
        d.prefill(0, contexts)
    for step in range(3):
        pending = torch.randint(0, 48, (3, 2), generator=gen)
        counts, draws = torch.tensor([2, 1, 2]), torch.tensor([[11, step], [12, step], [13, step]])
        args = (pending, counts, [2, 2, 2], [3, 3, 3], params, draws)
        want, got = eager.propose(*args), replayed.propose(*args)
        assert torch.equal(got[0], want[0])
        assert_same(got[1:], want[1:])
        assert_same(replayed._suffix, eager._suffix)
        for d in (eager, replayed):
            d.commit(torch.tensor([0, 1, 0]), torch.tensor([2, 0, 1]))
    assert replayed.proposals.replays == 3 and {key[1] for key in replayed.proposals._graphs} == {4}


def test_the_fused_kernels_compute_the_composed_forward(monkeypatch):
    """F.rms_norm and one scaled_dot_product_attention call per layer (with the masks as one
    additive bias) give the composed forward's outputs: a tree pass over a ragged prefix, and
    a feature draft's depth with K rows over a suffix (GQA: 2 query heads a kv head)."""
    _, target, draft = tiny_pair(vocab=48, draft_fc=torch.randn(64, 128) * 0.1)
    cache = committed_cache(target, [5, 9, 2])
    tree = tree_inputs(3, 7, cache, 4)
    composed = target(*tree[:2], cache, tree[2], window=16)
    d_cache = committed_cache(draft, [4, 7, 1])
    gen = torch.Generator().manual_seed(2)
    shape = (draft.spec.num_layers, 3, 2, draft.kv_heads, 2, draft.spec.head_dim)
    suffix = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    tokens = torch.randint(0, 48, (3, 2, 1), generator=gen)
    positions = (d_cache.lengths[:3] + 2)[:, None, None].expand(3, 2, 1)
    features = torch.randn(3, 2, 1, 64, generator=gen)
    depth = (tokens, positions, d_cache, torch.ones(3, 2, 1, 1, dtype=torch.bool), suffix)
    composed_depth = draft(*depth, features=features)
    monkeypatch.setattr(llama, "fused_kernels", lambda device: True)
    assert_same(target(*tree[:2], cache, tree[2], window=16), composed)
    assert_same(draft(*depth, features=features), composed_depth)


def test_the_joined_keys_compute_the_composed_forward(monkeypatch):
    """With one row a request, the prefix's keys joined to the new ones (two products a layer,
    as 16-bit forwards run) give the four products' outputs: a tree pass over a ragged prefix,
    and a one-path draft depth over a suffix. K rows, which share the prefix, never join."""
    _, target, draft = tiny_pair(vocab=48, draft_fc=torch.randn(64, 128) * 0.1)
    cache = committed_cache(target, [5, 9, 2])
    tree = tree_inputs(3, 7, cache, 4)
    d_cache = committed_cache(draft, [4, 7, 1])
    gen = torch.Generator().manual_seed(2)

    def depth(k: int) -> tuple:  # a draft depth of k rows a request over a suffix of 2
        shape = (draft.spec.num_layers, 3, k, draft.kv_heads, 2, draft.spec.head_dim)
        suffix = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        tokens = torch.randint(0, 48, (3, k, 1), generator=gen)
        positions = (d_cache.lengths[:3] + 2)[:, None, None].expand(3, k, 1)
        mask = torch.ones(3, k, 1, 1, dtype=torch.bool)
        return tokens, positions, d_cache, mask, suffix

    one, two = depth(1), depth(2)
    features = torch.randn(3, 1, 1, 64, generator=gen)
    joined = []
    spied = llama._joined_tree_attention
    monkeypatch.setattr(llama, "_joined_tree_attention", lambda *a: joined.append(1) or spied(*a))
    composed = target(*tree[:2], cache, tree[2], window=16)
    composed_depth = draft(*one, features=features)
    assert not joined  # float32 reads the prefix in place
    monkeypatch.setattr(llama, "joins_keys", lambda dtype: True)
    assert_same(target(*tree[:2], cache, tree[2], window=16), composed)
    assert_same(draft(*one, features=features), composed_depth)
    assert len(joined) == target.spec.num_layers + draft.spec.num_layers
    draft(*two, features=features.expand(3, 2, 1, 64))
    assert len(joined) == target.spec.num_layers + draft.spec.num_layers
    monkeypatch.undo()
    assert llama.joins_keys(torch.bfloat16) and not llama.joins_keys(torch.float32)


def test_a_target_shard_replays_where_asked_and_unsplit(monkeypatch):
    """The service's switch (ReplicaConfig.cuda_graphs, through ActorSpec): a shard replays its
    tree pass where graphs are available (faked here: the capture itself needs a GPU) unless
    told not to, and never when split (its forward all-reduces)."""
    from blockspec.service.config import ReplicaConfig
    from blockspec.workers import compiled
    from blockspec.workers.compiled import DecodeForwards
    from blockspec.workers.models import TINY_TARGET
    from blockspec.workers.tensor_parallel import TargetShard

    assert ReplicaConfig().cuda_graphs and not ReplicaConfig(cuda_graphs=False).cuda_graphs
    monkeypatch.setattr(compiled, "graphs_available", lambda device: True)
    forward = {
        (world, flag): type(
            TargetShard(TINY_TARGET, 0, world, 2, 64, forwards=DecodeForwards(flag)).worker.forward
        )
        for world, flag in ((1, True), (1, False), (2, True))
    }
    assert forward[1, True] is ForwardGraphs
    assert forward[1, False] is not ForwardGraphs and forward[2, True] is not ForwardGraphs
