"""The speculation cache (workers/speculation.py) and the counter-based draft uniforms it rests
on (workers/sampling.py), on the tiny random pairs through the in-process engine.

- Seeded output is the same with the cache on and off, alone and in a batch mixing every method,
  K and γ (plain requests included), at T = 1 and 0.7, and the cache does hit.
- Exact output law (chi-square, the engine-level test of tests/test_engine.py: 12,000 seeded
  requests, 4 tokens over γ = 2, so every request crosses a step) with the cache on, when every
  outcome is prepared (forced hits: the fan-out covers all of them) and when none is (forced
  misses: every proposal drafted on demand in a fork).
- Two lossy mutants are rejected by the same law test: a cache whose key forgets the emitted
  token y (a proposal reused for the wrong prefix; under greedy_block and spectr_gbv, whose
  carried record was written against the draft's law at the real prefix), and draft uniforms
  keyed by the drafted token's own position (a redraft then reuses the uniforms the rejected
  block's verification read; under block verification).
- With a feature draft the cache means its own-feature law: seeded output is the same whatever
  hits (against every proposal drafted on demand, and in the Ray actors), it is not the output
  without a cache, and its output law is the target's with forced hits, forced misses and both.

Power: at 12,000 trials the law test's 256 cells (V = 4, 4 tokens) reject a deviation of
noncentrality λ ≈ 60 with probability > 0.9 at ALPHA; each mutant is required to reach a
p-value below 1e-6, so a mutant that passed would show in the test, not hide behind chance.
"""

from __future__ import annotations

import functools

import pytest
import torch
from harness import ALPHA, WindowModel, decode_loop, loop_law_pvalue, method_step
from test_engine import MIXED, engine_law_pvalue, exact_target_law, make_engine, tiny_pair
from test_feature_draft import random_fc

from blockspec.service.requests import GenerationRequest, make_request
from blockspec.verification.tensors import counter_uniforms
from blockspec.workers.sampling import SamplingParams, downweight_top, draft_key, draft_uniforms
from blockspec.workers.speculation import SpeculationCache, speculation_cache

TRIALS = 12_000
PROMPT, GAMMA, LENGTH = [1, 3, 0], 2, 4


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=48)


@functools.cache
def narrow_pair(noise: float):
    """The engine law tests' V = 4 pair (its draft a copy of the target with noise this large),
    and the target's exact law of 4 tokens."""
    _, target, draft = tiny_pair(vocab=4, seed=5, noise=noise)
    return target, draft, exact_target_law(target, PROMPT, LENGTH, 4)


def law_pvalue(noise: float, method: str, k: int, cache: SpeculationCache) -> float:
    target, draft, law = narrow_pair(noise)
    engine = make_engine(target, draft, max_batch=2_000, max_len=16, speculation=cache)
    return engine_law_pvalue(engine, law, PROMPT, GAMMA, method, k, TRIALS)[0]


def mixed_requests(limits, sampling: SamplingParams, seed: int) -> list[GenerationRequest]:
    """One request per setting of MIXED (every method, K and γ), 24 tokens, seeds from `seed`."""
    return [
        make_request(limits, [5, 1 + i, 7, 3], 24, m, kk, g, sampling, seed=seed + i)
        for i, (m, kk, g) in enumerate(MIXED)
    ]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_seeded_output_is_the_same_with_the_cache_on_and_off(pair, temperature):
    _, target, draft = pair
    sampling = SamplingParams(temperature, top_k=20 if temperature < 1 else 0)
    cache = SpeculationCache(fanout=8)
    off = make_engine(target, draft, max_batch=len(MIXED))
    on = make_engine(target, draft, max_batch=len(MIXED), speculation=cache)

    requests = functools.partial(mixed_requests, off.limits, sampling)

    for seed in (0, 100):
        alone = [off.generate([r])[0].token_ids for r in requests(seed)]
        assert [on.generate([r])[0].token_ids for r in requests(seed)] == alone, seed
        assert [r.token_ids for r in on.generate(requests(seed))] == alone, seed
    assert 0 < cache.hits < cache.lookups and cache.prepared >= cache.hits


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_the_drafts_state_after_each_step_is_the_one_drafting_on_demand_leaves(pair, temperature):
    """Cache on and off in lockstep over a mixed batch whose widest request (γ = 5) finishes
    first: after every step both drafts hold the same committed tokens (lengths, and keys and
    values to float tolerance), so a hit leaves what a miss would have. Greedy, the others
    accept whole blocks right after the widest leaves (a hit's proposal was drafted beside it)."""
    _, target, draft = pair
    cache = SpeculationCache(fanout=8)
    engines = [
        make_engine(target, draft, max_batch=len(MIXED)),
        make_engine(target, draft, max_batch=len(MIXED), speculation=cache),
    ]
    for engine in engines:
        for i, (m, kk, g) in enumerate(MIXED):
            length = 2 if g == 5 else 30
            sampling = SamplingParams(temperature)
            engine.add(
                make_request(engine.limits, [5, 1 + i, 7, 3], length, m, kk, g, sampling, seed=i)
            )
    while engines[0].active or engines[0].waiting:
        for engine in engines:
            engine.step()
        off, on = (e.draft.cache for e in engines)
        n = len(engines[0].active)
        assert [a.output for a in engines[0].active] == [a.output for a in engines[1].active]
        assert torch.equal(off.lengths[:n], on.lengths[:n])
        for i, length in enumerate(off.lengths[:n].tolist()):
            for a, b in ((off.k, on.k), (off.v, on.v)):  # entries of magnitude ~10
                gap = (a[:, i, :, :length] - b[:, i, :, :length]).abs().max()
                assert gap < 1e-3, (i, float(gap))
    assert cache.hits > 0


def test_above_its_batch_limit_the_cache_prepares_nothing(pair):
    """The policy: a step with more drafted requests than max_batch prepares nothing (once
    the batch has shrunk under it, it prepares again), and the output stays the one without
    a cache."""
    _, target, draft = pair
    cache = SpeculationCache(fanout=4, max_batch=3)
    on = make_engine(target, draft, max_batch=8, speculation=cache)
    off = make_engine(target, draft, max_batch=8)
    sampling = SamplingParams(1.0)
    reqs = [
        make_request(off.limits, [5, 1 + i, 7], 6 + 4 * i, "block", 1, 3, sampling, seed=i)
        for i in range(8)
    ]
    ids = [on.add(r) for r in reqs]
    finished = {}
    while on.active or on.waiting:
        drafting = len(on.active or on.waiting)
        before = cache.prepared
        finished.update((r.request_id, r.token_ids) for r in on.step().finished)
        assert drafting <= 3 or cache.prepared == before, drafting
    assert cache.prepared > 0
    assert [finished[i] for i in ids] == [r.token_ids for r in off.generate(reqs)]


def test_greedy_requests_rank_recovered_tokens_by_the_drafts_beliefs(pair):
    """At temperature 0 the draft's rows are one-hot, so they rank nothing after a rejection;
    the cache ranks by the draft's rows at temperature 1 (`DraftProposer.beliefs`). On the tiny
    pair that hits 57 of 207 lookups at F = 2 (ranked by the one-hot rows: 2)."""
    _, target, draft = pair
    engine = make_engine(target, draft, max_batch=8)
    cache = speculation_cache(engine.draft, 2)
    engine.executor.speculation = cache
    greedy = SamplingParams(0.0)
    engine.generate(
        [
            make_request(engine.limits, [5, 1 + i, 7, 3], 40, "block", 1, 3, greedy, seed=i)
            for i in range(8)
        ]
    )
    assert cache.hits > 0.15 * cache.lookups, (cache.hits, cache.lookups)


class NeverHits(SpeculationCache):
    """Forced misses: nothing is prepared, every proposal is drafted on demand (as without a
    cache: no hit in the step)."""

    def prepare(self, *args) -> None:
        pass


@pytest.mark.parametrize(
    ("method", "k", "fanout"),
    [("block", 1, 12), pytest.param("gbv", 2, 24, marks=pytest.mark.slow)],
)
def test_output_law_with_every_outcome_prepared(method, k, fanout):
    """Forced hits: the fan-out covers every prefix a step can emit (K·(γ+1)·V = 12 per path)."""
    cache = SpeculationCache(fanout)
    pvalue = law_pvalue(0.3, method, k, cache)
    assert pvalue > ALPHA, f"{method}: p = {pvalue:.2e}"
    assert cache.hits == cache.lookups > 0


def test_output_law_with_saguaro_sampling():
    """The draft's rows with their 4 likeliest tokens scaled by 0.3 (another draft law, the
    one it reports): the output keeps the target's law, hits and misses mixed."""
    target, draft, law = narrow_pair(0.3)
    engine = make_engine(target, draft, max_batch=2_000, max_len=16)
    cache = speculation_cache(engine.draft, 4, downweight=0.3)
    engine.executor.speculation = cache
    pvalue = engine_law_pvalue(engine, law, PROMPT, GAMMA, "spectr_gbv", 2, TRIALS)[0]
    assert pvalue > ALPHA, f"p = {pvalue:.2e}"
    assert engine.draft.downweight == (4, 0.3) and 0 < cache.hits < cache.lookups


def test_downweighted_rows_scale_the_top_tokens_and_keep_one_hot_rows():
    rows = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.0, 1.0, 0.0, 0.0]])
    out = downweight_top(rows, 2, 0.5)
    expected = torch.tensor([0.1, 0.2, 0.2, 0.15]) / 0.65
    assert torch.allclose(out[0], expected) and torch.equal(out[1], rows[1])
    with pytest.raises(ValueError, match="downweight"):
        speculation_cache(None, 4, downweight=0.0)


@pytest.mark.parametrize(
    ("method", "k"), [("greedy_block", 1), pytest.param("traversal", 2, marks=pytest.mark.slow)]
)
def test_output_law_with_every_proposal_drafted_on_demand(method, k):
    cache = NeverHits(fanout=1)
    pvalue = law_pvalue(0.3, method, k, cache)
    assert pvalue > ALPHA, f"{method}: p = {pvalue:.2e}"
    assert cache.hits == 0 and cache.lookups > 0


class ForgetsTheToken(SpeculationCache):
    """Mutant: entries keyed without the emitted token y, so a proposal prepared for one
    prefix serves another that differs in its last token."""

    @staticmethod
    def key(request_id, root, prefix, k, gamma):
        return request_id, root, prefix[:-1], k, gamma


# The carried records of greedy_block and spectr_gbv are written against the draft's law at the
# real prefix; a proposal drawn for another prefix is still drawn from the q it reports, so the
# methods without a carry stay lossless under this mutant (not a case here). The pair with the
# farther draft (noise 1.0) makes the wrong prefix's law differ enough to show at 12,000 trials;
# on it, the real cache at the same fan-out (a mix of hits and misses) is the control.
@pytest.mark.parametrize(
    ("method", "k"), [pytest.param("greedy_block", 1, marks=pytest.mark.slow), ("spectr_gbv", 2)]
)
def test_output_law_with_hits_and_misses(method, k):
    cache = SpeculationCache(fanout=4)
    pvalue = law_pvalue(1.0, method, k, cache)
    assert pvalue > ALPHA, f"{method}: p = {pvalue:.2e}"
    assert 0 < cache.hits < cache.lookups


@pytest.mark.parametrize(
    ("method", "k"), [pytest.param("greedy_block", 1, marks=pytest.mark.slow), ("spectr_gbv", 2)]
)
def test_a_proposal_reused_for_the_wrong_prefix_is_rejected(method, k):
    pvalue = law_pvalue(1.0, method, k, ForgetsTheToken(fanout=4))
    assert pvalue < 1e-5, f"{method}: the mutant passed, p = {pvalue:.2e}"


def uniforms_keyed_by_the_token_position(draws: torch.Tensor, k: int, gamma: int):
    """Mutant of draft_uniforms: the drafted token's own position (root + 1 + depth) instead
    of (root, depth), so a redraft at a position reuses the rejected draft's uniform there."""
    key, root = draws[:, 0, None, None], draws[:, 1, None, None]
    path = torch.arange(k)[None, :, None]
    position = root + 1 + torch.arange(gamma)[None, None, :]
    return counter_uniforms(key, position, path << 32)


# Loop-level tables (tests/harness.py), V = 3, Markov on the last token, where a reused uniform
# shows: the draft's row is the same after every context ({0, 1} at 1/2 each), so a redraft
# keyed by the token's position redraws exactly the token the last step drafted there, which
# the outcome (a rejection before it) made unlikely to be one the target favours.
FLAT_DRAFT = WindowModel.from_fn(3, 1, lambda prefix: [0.5, 0.5, 0.0])
TARGET_ROWS = {
    # asymmetric after 0 and 1: a block rejected at depth 0 carried a skewed second token
    "asymmetric": {
        None: [0.3, 0.3, 0.4],
        0: [0.9, 0.05, 0.05],
        1: [0.5, 0.4, 0.1],
        2: [0.1, 0.1, 0.8],
    },
    # symmetric: what multi-path GBV's choice of path skews
    "symmetric": {
        None: [0.3, 0.3, 0.4],
        0: [0.9, 0.05, 0.05],
        1: [0.05, 0.9, 0.05],
        2: [0.1, 0.1, 0.8],
    },
}
LOOP_CASES = [
    ("block", 1, "asymmetric"),
    ("greedy_block", 1, "asymmetric"),
    ("gbv", 2, "symmetric"),
]


def loop_pvalue(method: str, k: int, table: str, uniforms) -> float:
    """The loop law (200,000 trials, γ = 2, 4 tokens) with the draft's tokens drawn from
    counter-based uniforms (`uniforms`, keyed by each trial's key and root position)."""
    rows = TARGET_ROWS[table]
    target = WindowModel.from_fn(3, 1, lambda prefix: rows[prefix[-1] if prefix else None])
    seq = decode_loop(
        method_step(method), target, FLAT_DRAFT, 200_000, k, 2, 4, seed=3, draft_uniforms=uniforms
    )
    return loop_law_pvalue(seq, target)


@pytest.mark.parametrize(("method", "k", "table"), [*LOOP_CASES, ("token", 1, "asymmetric")])
def test_loop_law_with_the_engines_counter_based_draft_uniforms(method, k, table):
    pvalue = loop_pvalue(method, k, table, draft_uniforms)
    assert pvalue > ALPHA, f"{method}: p = {pvalue:.2e}"


@pytest.mark.parametrize(("method", "k", "table"), LOOP_CASES)
def test_draft_uniforms_keyed_by_the_token_position_are_rejected(method, k, table):
    """The mutant is lossy under methods whose outcome reads the block past the rejection
    (token verification reads no further than it, and stays lossless: not a case here).
    Its uniforms alone are as uniform as the real ones (checked first): what makes it lossy
    is only their reuse across steps."""
    draws = torch.tensor([[draft_key(s), 9] for s in range(4096)])
    u = uniforms_keyed_by_the_token_position(draws, 2, 8)
    counts = torch.histc(u.flatten().float(), bins=16, min=0.0, max=1.0)
    expected = u.numel() / 16
    assert float(((counts - expected) ** 2 / expected).sum()) < 60.0  # 15 dof: P ≈ 1e-7
    pvalue = loop_pvalue(method, k, table, uniforms_keyed_by_the_token_position)
    assert pvalue < 1e-6, f"{method}: the mutant passed, p = {pvalue:.2e}"


@pytest.fixture(scope="module")
def feature_pair():
    """The V = 48 pair with a feature draft (tests/test_feature_draft.py's)."""
    return tiny_pair(vocab=48, draft_fc=random_fc(64, scale=0.1))


@functools.cache
def narrow_feature_pair():
    """The law tests' V = 4 pair with a feature draft whose features move q far (scale 3, as
    tests/test_feature_draft.py's law test), and the target's exact law of 4 tokens."""
    _, target, draft = tiny_pair(vocab=4, seed=5, noise=0.3, draft_fc=random_fc(64, 3.0, seed=1))
    return target, draft, exact_target_law(target, PROMPT, LENGTH, 4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_feature_draft_speculates_under_its_own_feature_law(feature_pair, temperature):
    """With a feature draft the cache on means its own-feature law (workers/speculation.py):
    seeded output is the same whatever hits, as with every proposal drafted on demand, alone
    and in a batch mixing every method, K and γ; and the law is not the one without a cache."""
    _, target, draft = feature_pair
    sampling = SamplingParams(temperature, top_k=20 if temperature < 1 else 0)
    cache = SpeculationCache(fanout=8)
    on_demand = make_engine(target, draft, max_batch=len(MIXED), speculation=NeverHits(1))
    on = make_engine(target, draft, max_batch=len(MIXED), speculation=cache)
    off = make_engine(target, draft, max_batch=len(MIXED))
    requests = functools.partial(mixed_requests, off.limits, sampling)
    for seed in (0, 100):
        alone = [on_demand.generate([r])[0].token_ids for r in requests(seed)]
        assert [on.generate([r])[0].token_ids for r in requests(seed)] == alone, seed
        assert [r.token_ids for r in on.generate(requests(seed))] == alone, seed
        assert [r.token_ids for r in off.generate(requests(seed))] != alone, seed
    assert 0 < cache.hits < cache.lookups and cache.prepared >= cache.hits


def feature_law_pvalue(method: str, k: int, cache: SpeculationCache) -> float:
    target, draft, law = narrow_feature_pair()
    engine = make_engine(target, draft, max_batch=2_000, max_len=16, speculation=cache)
    return engine_law_pvalue(engine, law, PROMPT, GAMMA, method, k, TRIALS)[0]


@pytest.mark.parametrize(
    ("method", "k", "cache"),
    [
        ("block", 1, lambda: SpeculationCache(12)),  # every rejection's outcome prepared
        ("greedy_block", 1, lambda: NeverHits(1)),  # every proposal drafted on demand
        ("spectr_gbv", 2, lambda: SpeculationCache(2)),  # hits and misses
        pytest.param("gbv", 2, lambda: SpeculationCache(4), marks=pytest.mark.slow),
    ],
)
def test_output_law_with_a_feature_draft(method, k, cache):
    """The own-feature law keeps the target's output law: forced hits (F = 12 covers every
    outcome a rejection can emit; full acceptances are never prepared), forced misses, and a
    mix, under methods with and without carried records."""
    made = cache()
    pvalue = feature_law_pvalue(method, k, made)
    assert pvalue > ALPHA, f"{method}: p = {pvalue:.2e}"
    assert made.lookups > 0 and (made.hits > 0) == (made.fanout > 1)


@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize("kind", [pytest.param("token", marks=pytest.mark.slow), "feature"])
def test_through_the_actors_the_seeded_output_is_the_one_without_a_cache(service, tmp_path, kind):
    """A replica's draft actor with a speculation cache (prepared while the target actor
    verifies): 1,000 seeded requests (spectr_gbv K = 2, a carried method, 3 tokens over γ = 2)
    write exactly what the in-process engine writes without a cache (a feature draft: with
    every proposal drafted on demand, its own-feature law), whose law the tests above and
    tests/test_engine.py check; and the cache hit."""
    from test_draft_kinds import GAMMA as G
    from test_draft_kinds import LENGTH as L
    from test_draft_kinds import PROMPT as P
    from test_draft_kinds import VOCAB, save_pair

    from blockspec.service.config import ReplicaConfig
    from blockspec.service.replica import build_remote_engine
    from blockspec.workers.models import load_model
    from tests.live_service import stop_remote_engine

    draft_dir, target_dir = save_pair(tmp_path, kind)
    target, draft = load_model(target_dir).build(), load_model(draft_dir).build()
    law = exact_target_law(target, P, L, VOCAB)
    cfg = ReplicaConfig(
        draft_dir=str(draft_dir),
        target_dir=str(target_dir),
        max_batch=128,
        max_sessions=0,
        max_len=32,
        speculation=4,
        speculation_max_batch=128,
    )
    remote, _ = build_remote_engine(cfg)
    try:
        _, through = engine_law_pvalue(remote, law, P, G, "spectr_gbv", 2, 1_000)
        stats = remote.draft.speculation_stats()
    finally:
        stop_remote_engine(remote)
    assert 0 < stats["hits"] < stats["lookups"]
    own_law = NeverHits(1) if kind == "feature" else None
    local = make_engine(target, draft, max_batch=128, max_len=32, speculation=own_law)
    _, alone = engine_law_pvalue(local, law, P, G, "spectr_gbv", 2, 1_000)
    assert [r.token_ids for r in through] == [r.token_ids for r in alone]
