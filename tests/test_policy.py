"""`method: auto` (service/policy.py): the policy's choices, and the engine's output law while
the policy switches method, K and γ from step to step."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from harness import ALPHA, chi_square
from test_engine import exact_target_law, make_engine, tiny_pair

from blockspec.service.config import ReplicaConfig
from blockspec.service.policy import (
    Acceptance,
    Arm,
    AutoPolicy,
    AutoState,
    StepShape,
    expected_tokens,
)
from blockspec.service.requests import make_request
from blockspec.workers.sampling import SamplingParams


def test_expected_tokens_counts_the_accepted_prefix_and_stops_at_remaining():
    assert expected_tokens([], 10) == 1.0  # plain decoding
    assert expected_tokens([0.5, 0.5], 10) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0, 1.0, 1.0], 2) == 2.0  # one token left after the first


def test_acceptance_rates_are_conditional_and_shrunk_toward_the_replica():
    counts = Acceptance()
    for tau in (0, 1, 2, 2):  # γ = 2: position 1 reached 4×, accepted 3×; position 2: 3×, 2×
        counts.add(2, tau)
    assert counts.rates(3) == [0.75, 2 / 3, 2 / 3]  # position 3 never drafted: the last rate
    prior = [0.25, 0.25]
    shrunk = counts.rates(2, prior)
    assert 0.25 < shrunk[0] < 0.75 and shrunk[0] == pytest.approx((3 + 8 * 0.25) / (4 + 8))


# A CPU-like step cost, linear in StepShape.features: [1, batch, depth, nodes, multi, prefill].
TRUE_COST = [0.1, 0.01, 0.01, 0.01, 0.002, 0.0005]


def true_seconds(shape: StepShape, arm, n_auto: int) -> float:
    return sum(c * x for c, x in zip(TRUE_COST, shape.features(arm, n_auto), strict=True))


def run(policy: AutoPolicy, steps: int, sizes, tau_of, seed: int = 0) -> list[AutoState]:
    """`steps` choices at batch sizes drawn from `sizes` (and random prefill), each observed
    with its true cost ±5% and `tau_of(arm)` accepted tokens for every request."""
    rng = random.Random(seed)
    states = []
    for _ in range(steps):
        shape = StepShape(rng.choice(sizes), prefill_tokens=rng.choice([0, 0, 0, 120, 300]))
        states = [AutoState(max_gamma=8, remaining=100) for _ in range(shape.batch_size)]
        arm = policy.choose(states, shape)
        seconds = true_seconds(shape, arm, len(states)) * rng.uniform(0.95, 1.05)  # noise
        policy.observe(arm, shape, seconds, [(s, tau_of(arm)) for s in states])
    return states


def best_arm(policy: AutoPolicy, shape: StepShape, tokens) -> str:
    """The arm with the most true tokens per second (tokens(arm) per request)."""
    return str(max(policy.arms, key=lambda a: tokens(a) / true_seconds(shape, a, shape.batch_size)))


ARMS = ["none", "block/1/2", "block/1/4", "gbv/2/3"]


@pytest.mark.parametrize("seed", range(4))
def test_the_cost_model_carries_small_batches_to_large_ones(seed):
    """Steps at batch 1-8, mostly of one arm (it wins), teach every arm's step cost at batch
    16 and 32, where none ran."""
    policy = AutoPolicy(ARMS)
    run(policy, 300, sizes=[1, 2, 4, 8], tau_of=lambda arm: arm.gamma, seed=seed)
    for batch in (16, 32):
        shape = StepShape(batch, prefill_tokens=100)
        for arm in policy.arms:
            predicted = policy.cost.predict(shape.features(arm, batch), arm)
            assert predicted == pytest.approx(true_seconds(shape, arm, batch), rel=0.1), arm


ACCEPTED = {
    "all": lambda arm: arm.gamma,
    "first": lambda arm: min(arm.gamma, 1),
    "none": lambda arm: 0,
}


@pytest.mark.parametrize(
    ("accepted", "winners"),
    [("all", ("block/1/4", "block/1/4")), ("first", ("block/1/2", "none")),
     ("none", ("none", "none"))],
)  # fmt: skip
def test_policy_picks_the_most_tokens_per_second(accepted, winners):
    """At batch 1 and 32 the policy picks the arm with the most true tokens per second: drafts
    always accepted keep γ = 4; only the first token accepted: γ = 2 at one request and plain
    decoding at 32, where the tree costs more than it gives; nothing accepted: plain."""
    tau_of = ACCEPTED[accepted]
    policy = AutoPolicy(ARMS)
    run(policy, 300, sizes=[1, 2, 4, 8], tau_of=tau_of)
    for batch, winner in zip((1, 32), winners, strict=True):
        shape = StepShape(batch)
        states = [AutoState(max_gamma=8, remaining=100) for _ in range(batch)]
        for s in states:  # the requests' own history agrees with the replica's
            for arm in policy.arms[1:]:
                for _ in range(4):
                    s.arms.setdefault(arm, Acceptance()).add(arm.gamma, tau_of(arm))
        assert best_arm(policy, shape, lambda a: 1 + tau_of(a)) == winner  # the oracle
        assert str(policy.choose(states, shape)) == winner


def test_a_request_near_its_end_or_its_context_limit_gets_a_short_draft():
    policy = AutoPolicy(["block/1/1", "block/1/4"])
    run(policy, 40, sizes=[1, 2], tau_of=lambda arm: arm.gamma)
    (state,) = [AutoState(max_gamma=8, remaining=100)]
    for arm in policy.arms:
        state.arms[arm] = Acceptance()
        state.arms[arm].add(arm.gamma, arm.gamma)
    assert str(policy.choose([state], StepShape(1))) == "block/1/4"
    state.remaining = 2  # γ = 4 would emit at most 2 tokens, for more time
    assert str(policy.choose([state], StepShape(1))) == "block/1/1"
    state.remaining, state.max_gamma = 100, 3  # γ = 4 no longer fits the context
    assert str(policy.choose([state], StepShape(1))) == "block/1/1"


def test_policy_explores_each_arm_then_revisits_its_stalest():
    policy = AutoPolicy(["none", "block/1/2"], revisit=8)
    chosen = []
    for _ in range(20):
        state = AutoState(max_gamma=8, remaining=100)
        arm = policy.choose([state], StepShape(1))
        policy.observe(arm, StepShape(1), 1.0 if arm.method == "none" else 5.0, [(state, 0)])
        chosen.append(str(arm))
    # 2 + 2 exploring steps, then `none` except at choices 8 and 16: block/1/2, run longest ago.
    assert chosen[:4] == ["none", "none", "block/1/2", "block/1/2"]
    assert [i + 1 for i, c in enumerate(chosen[4:], 4) if c != "none"] == [8, 16]


@pytest.mark.parametrize(
    ("arm", "field"),
    [("greedy_block/1/4", "carries"), ("spectr_gbv/2/4", "carries"), ("nope/1/2", "unknown"),
     ("block/2/4", "K = 1"), ("block/1", "method/K/γ"), ("gbv/2/0", ">= 1")],
)  # fmt: skip
def test_bad_arms_are_refused_naming_them(arm, field):
    with pytest.raises(ValueError, match=f"auto_arms: '{arm}'.*{field}"):
        Arm.parse(arm)
    with pytest.raises(ValueError, match="auto_arms"):
        ReplicaConfig(auto_arms=[arm])


def test_arms_past_the_deployment_limits_are_refused():
    with pytest.raises(ValueError, match="exceeds max_k or max_gamma"):
        ReplicaConfig(auto_arms=["none", "block/1/8"], max_gamma=6)


def test_engine_law_equals_target_law_while_auto_switches():
    """Engine-level losslessness with the real policy switching arms: `revisit=2` makes every
    other choice re-measure the stalest arm, so single- and multi-path methods and plain
    decoding alternate within each request, requests join mid-way (max_batch < trials) and
    exploitation picks by the requests' own acceptance. Power as in test_engine's law test
    (the same trials and table size)."""
    vocab, length, trials = 4, 4, 12_000
    _, target, draft = tiny_pair(vocab=vocab, seed=5, noise=0.3)
    prompt = [1, 3, 0]
    law = exact_target_law(target, prompt, length, vocab)
    engine = make_engine(target, draft, max_batch=64, max_len=16)
    engine.policy = AutoPolicy(["none", "token/1/1", "block/1/2", "gbv/3/2", "traversal/2/2"],
                               revisit=2)  # fmt: skip
    reqs = [
        make_request(engine.limits, prompt, length, "auto", sampling=SamplingParams(), seed=i)
        for i in range(trials)
    ]
    results = engine.generate(reqs)
    ran = Counter()
    for r in results:
        ran.update(r.stats.steps_by_config)
    assert set(ran) == {"none", "token/1/1", "block/1/2", "gbv/3/2", "traversal/2/2"}, ran
    assert min(ran.values()) > 0.05 * sum(ran.values()), ran  # every arm served real steps
    outcomes = Counter(",".join(map(str, r.token_ids)) for r in results)
    _, _, pvalue = chi_square(outcomes, law, trials)
    assert pvalue > ALPHA, f"auto: p = {pvalue:.2e}"


def test_default_arms_stay_within_the_deployment_limits():
    assert ReplicaConfig(max_gamma=3, max_k=1).auto_arms == [
        "none", "block/1/1", "block/1/2", "block/1/3"
    ]  # fmt: skip
