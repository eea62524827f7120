"""Every method with every kind of draft the project loads: the engine's output law.

The verifier-level law tests (test_reference_laws.py, test_loop_lossless.py) draft from fixed
conditional tables, so they cannot see what only a real draft model does between steps. A
*feature draft* (EAGLE) is the case in point: it scores the positions past a step's root with
its own features, and the same prefix with the target's features once it is rerun at the next
step, so its law for a prefix depends on the step that drafts it. Greedy block verification and
SpecTr-GBV* carry records written against the law of the step that drafted; an engine that let
the next step draft with the rerun law was measurably lossy (the mutant test below), and the
engine keeps the recording law while a record is live (workers/feature_draft.py).

Draft kinds, each saved as a checkpoint directory and loaded like a user's pair:
- ``token``: a perturbed copy of the target whose untied head is 1.7x its embedding (q sharper
  than p);
- ``feature``: the same plus a random `feature_fc` projection (weight [64, 128], standard
  normal), which moves q far with the features;
- ``feature_reduced``: the feature draft with a head that keeps 4 of the 6 ids
  (`draft_vocab.json`: q = 0 on the others).

The law: prompt [1, 4, 2], 3 tokens at temperature 1, γ = 2, so a request crosses at least one
iteration boundary and a greedy record (window τ + 1 .. γ - 1) is live at the next step whenever
τ = 0; N = 6,000 seeded requests per (method, draft kind), compared with the target's exact law
(216 outcomes) by Pearson's chi-square at ALPHA = 1e-4 (tests/harness.py; cells under 5 expected
pooled).

Power: with ~100 cells of expected count >= 5 the critical value is ~160; a law off by Δ_c adds
λ = N Σ Δ_c² / p_c to the statistic, so λ ≈ 90 (Σ Δ²/p = 0.015, e.g. one outcome of probability
1.4% drawn 0.3 percentage points off, plus small changes elsewhere) is rejected with probability
about 0.9. The defect this suite was written for gives p < 1e-12 at N = 6,000 for both carried
methods and both feature kinds (`test_the_carried_records_mutant_is_lossy_with_a_feature_draft`
keeps it failing on purpose). Its size depends on the instance (on other random pairs it was as
small as p = 0.3), so the pair's seed is fixed to one where it shows.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from harness import ALPHA, chi_square
from test_engine import engine_law_pvalue, exact_target_law, make_engine, save_tiny, tiny_config

from blockspec.verification import METHODS, VERIFIERS
from blockspec.workers.models import DRAFT_VOCAB, FEATURE_FC, load_model
from tests.live_service import stop_remote_engine

KINDS = ("token", "feature", "feature_reduced")
PROMPT, LENGTH, GAMMA, VOCAB, TRIALS = [1, 4, 2], 3, 2, 6, 6000
CARRIED = [m for m in METHODS if VERIFIERS[m].modifies_target]


def save_pair(
    root: Path, kind: str, seed: int = 3, noise: float = 0.3, fc_scale: float = 1.0
) -> tuple[Path, Path]:
    """A random 2-layer Llama target (vocab 6) and a draft of `kind` (module docstring), as
    checkpoint directories with a word-level tokenizer; returns (draft_dir, target_dir)."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    cfg = tiny_config(VOCAB, tie_word_embeddings=True)
    target_dir, draft_dir = root / "target", root / "draft"
    save_tiny(target_dir, VOCAB)  # the tokenizer (its tiny model is overwritten below)
    save_tiny(draft_dir, VOCAB)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(cfg).eval()
    target.save_pretrained(target_dir)
    draft = LlamaForCausalLM(tiny_config(VOCAB, tie_word_embeddings=False))
    state = {k: v + noise * torch.randn_like(v) for k, v in target.state_dict().items()}
    state["lm_head.weight"] = 1.7 * state["model.embed_tokens.weight"]
    draft.load_state_dict(state, strict=False)
    draft.save_pretrained(draft_dir)
    if kind.startswith("feature"):
        save_file({"weight": fc_scale * torch.randn(64, 128)}, draft_dir / FEATURE_FC)
    if kind == "feature_reduced":
        (draft_dir / DRAFT_VOCAB).write_text(json.dumps([0, 2, 3, 5]))
    return draft_dir, target_dir


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """kind -> (draft Llama, target Llama, exact law of the 3 tokens)."""
    out = {}
    for kind in KINDS:
        draft_dir, target_dir = save_pair(tmp_path_factory.mktemp(kind), kind)
        target = load_model(target_dir).build()
        law = exact_target_law(target, PROMPT, LENGTH, VOCAB)
        out[kind] = (load_model(draft_dir).build(), target, law)
    return out


def law_pvalue(engine, law, method: str, k: int, trials: int = TRIALS):
    return engine_law_pvalue(engine, law, PROMPT, GAMMA, method, k, trials)


def paths(method: str) -> int:
    return 1 if VERIFIERS[method].single_path else 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", METHODS)
def test_output_law_equals_the_targets_for_every_method_and_draft_kind(pairs, method, kind):
    draft, target, law = pairs[kind]
    engine = make_engine(target, draft, max_batch=256, max_len=32)
    pvalue, results = law_pvalue(engine, law, method, paths(method))
    assert pvalue > ALPHA, f"{method} with a {kind} draft: p = {pvalue:.2e}"
    assert sum(r.stats.accepted for r in results) > TRIALS // 10  # drafts were accepted


@pytest.mark.parametrize("kind", ["feature", "feature_reduced"])
@pytest.mark.parametrize("method", CARRIED)
def test_the_carried_records_mutant_is_lossy_with_a_feature_draft(pairs, monkeypatch, method, kind):
    """Evidence of power: with the engine's old behaviour (the next step drafts with the
    target's true features while a record is live) the same test fails."""
    from dataclasses import replace

    from blockspec.workers import step as step_module

    verify_step = step_module.verify_step

    def never_live(*args):
        verdict = verify_step(*args)
        return replace(verdict, live=torch.zeros_like(verdict.live))

    monkeypatch.setattr(step_module, "verify_step", never_live)
    draft, target, law = pairs[kind]
    engine = make_engine(target, draft, max_batch=256, max_len=32)
    pvalue, _ = law_pvalue(engine, law, method, paths(method))
    assert pvalue < 1e-8, f"the mutant passed: p = {pvalue:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["feature", "feature_reduced"])
@pytest.mark.parametrize("method", CARRIED)
def test_carried_methods_hold_their_law_at_sixty_thousand_requests(pairs, method, kind):
    """Ten times the trials for the two methods that carry records (power ~0.9 at
    Σ Δ²/p = 0.0015)."""
    draft, target, law = pairs[kind]
    engine = make_engine(target, draft, max_batch=256, max_len=32)
    pvalue, _ = law_pvalue(engine, law, method, paths(method), trials=60_000)
    assert pvalue > ALPHA, f"{method} with a {kind} draft: p = {pvalue:.2e}"


# Seeded output against the KV a request finds parked. In float64: float32's rounding differs
# between a prompt prefilled in one pass and in pieces, which on this vocabulary of 6 can move a
# sampled token now and then (docs/client.md: what a seed guarantees); in float64 nothing of
# that shows, and what remains to test is the engine's logic.
SEEDED_RUNS = 8
SEEDED_PROMPT = [(i * 5 + 1) % VOCAB for i in range(20)]


@pytest.fixture
def float64(monkeypatch) -> str:
    from blockspec.workers import models

    monkeypatch.setitem(models.DTYPES, "float64", torch.float64)
    return "float64"


def _seeded_follow_ups(engine, method: str, session: bool) -> list[tuple[list[int], int]]:
    """Per seed: a request, then one that extends its prompt and output (as a chat's next
    turn does), through a session or a cached prefix; the second's tokens and cached tokens."""
    from blockspec.service.requests import GenerationRequest
    from blockspec.workers.sampling import SamplingParams

    def ask(prompt: list[int], new: int, seed: int, where: dict):
        request = GenerationRequest(
            tuple(prompt), new, method, paths(method), 3, SamplingParams(1.0), seed, **where
        )
        return engine.generate([request])[0]

    out = []
    for seed in range(SEEDED_RUNS):
        where = dict(session_id=f"s{seed}") if session else dict(cache_scope=f"u{seed}")
        first = ask(SEEDED_PROMPT, 7, 1 + seed, where)
        second = ask([*SEEDED_PROMPT, *first.token_ids, 1, 2], 8, 51 + seed, where)
        out.append((second.token_ids, second.cached_tokens))
    return out


@pytest.mark.parametrize(
    ("method", "speculation"),
    [("greedy_block", 0), ("spectr_gbv", 0), ("gbv", 0), ("block", 4), ("gbv", 4)],
)
def test_seeded_output_is_the_same_with_and_without_parked_kv(
    tmp_path, float64, method, speculation
):
    """A feature draft's cache positions written under its own features (a live record's
    path and the token after it; with the speculation cache, after a rejection) differ from
    what a cold prefill computes from the target's: parked KV is reused only up to the first
    of them. Before, 22-25 of 30 seeded follow-ups of greedy_block and spectr_gbv changed on
    a hit, and 17-19 of 20 of block, gbv and token with the speculation cache, in float64."""
    from blockspec.service.build import build_engine

    draft_dir, target_dir = save_pair(tmp_path, "feature")

    def engine(prefix_caching: bool):
        return build_engine(
            str(draft_dir), str(target_dir), max_batch=4, max_len=96, max_sessions=4,
            prefix_caching=prefix_caching, dtype=float64, speculation=speculation,
        )[0]  # fmt: skip

    cold = _seeded_follow_ups(engine(False), method, session=False)
    for session in (False, True):
        warm = _seeded_follow_ups(engine(True), method, session)
        assert all(cached > 0 for _, cached in warm), warm  # hits, every one
        assert [tokens for tokens, _ in warm] == [tokens for tokens, _ in cold], session


@pytest.mark.parametrize("method", ["block", "gbv"])
def test_speculation_cache_output_is_batch_independent_up_to_rounding(tmp_path, float64, method):
    """With the speculation cache a feature draft chains its own features from step to step,
    which amplifies float32's batch-shape rounding (docs/client.md: the boundary); the logic
    itself leaves a seeded request's tokens the same alone and in a batch of 24."""
    from blockspec.service.build import build_engine
    from blockspec.service.requests import GenerationRequest
    from blockspec.workers.sampling import SamplingParams

    draft_dir, target_dir = save_pair(tmp_path, "feature")
    requests = [
        GenerationRequest((2, 5, 1, s % 6), 12, method, paths(method), 2 + s % 2,
                          SamplingParams(1.0), 100 + s)
        for s in range(24)
    ]  # fmt: skip

    def engine():
        return build_engine(
            str(draft_dir), str(target_dir), max_batch=64, max_len=48, speculation=4,
            dtype=float64,
        )[0]  # fmt: skip

    together = [r.token_ids for r in engine().generate(requests)]
    single = engine()
    assert together == [single.generate([r])[0].token_ids for r in requests]


# Through the actors: by default SpecTr-GBV* with the reduced feature draft (the actor path's
# own state is the draft's kept features; of the methods, it carries records and reads several
# paths); every pair with -m slow. Each pair costs ~50 s on a loaded 2-core CI machine, and
# tests/test_service.py already checks that the actors give the in-process engine's bits, a
# sampled batch of every method with a feature draft, so the other laws follow from the
# in-process ones above.
ACTOR_DEFAULT = [("spectr_gbv", "feature_reduced")]
ACTOR_PAIRS = [
    pytest.param(m, kind, marks=() if (m, kind) in ACTOR_DEFAULT else pytest.mark.slow)
    for kind in KINDS
    for m in METHODS
]


@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize(("method", "kind"), ACTOR_PAIRS)
def test_output_law_through_the_actors(service, tmp_path, method, kind):
    """The same law through a replica's Ray actors (draft actor -> target rank 0, which
    verifies), where the draft's kept features live in the draft actor between steps."""

    from blockspec.service.config import ReplicaConfig
    from blockspec.service.replica import build_remote_engine

    draft_dir, target_dir = save_pair(tmp_path, kind)
    law = exact_target_law(load_model(target_dir).build(), PROMPT, LENGTH, VOCAB)
    cfg = ReplicaConfig(
        draft_dir=str(draft_dir),
        target_dir=str(target_dir),
        max_batch=256,
        max_sessions=0,
        max_len=32,
    )
    engine, _ = build_remote_engine(cfg)
    try:
        pvalue, _ = law_pvalue(engine, law, method, paths(method))
        assert pvalue > ALPHA, f"{method} with a {kind} draft through the actors: p = {pvalue:.2e}"
    finally:
        stop_remote_engine(engine)


@pytest.mark.parametrize(
    ("dtype", "method"), [("int8", "gbv"), ("int8", "greedy_block"), ("int4", "greedy_block")]
)
def test_a_rounded_target_and_draft_keep_the_rounded_targets_law(tmp_path, dtype, method):
    """`--dtype int8` rounds every projection and the head to int8 (workers/llama.Int8Linear),
    `--dtype int4` every decoder layer's projection to 4 bits in groups of 32
    (workers/llama.Int4Linear). On this random pair, whose weights lie on no such grid, either
    is another model, whose own law the verifiers keep, with a feature draft rounded alike (a
    carried method: its records too). The same seeded outputs reject the float target's law
    (int8 gbv: p = 5e-8 on this pair), so the test tells the two models apart."""
    from blockspec.service.build import build_engine

    draft_dir, target_dir = save_pair(tmp_path, "feature")
    rounded = load_model(target_dir, dtype).build()
    law = exact_target_law(rounded, PROMPT, LENGTH, VOCAB, torch.bfloat16)
    engine = build_engine(str(draft_dir), str(target_dir), 256, max_len=32, dtype=dtype)[0]
    pvalue, results = law_pvalue(engine, law, method, paths(method))
    assert pvalue > ALPHA, f"{method}, {dtype}: p = {pvalue:.2e}"
    exact = exact_target_law(load_model(target_dir).build(), PROMPT, LENGTH, VOCAB)
    outcomes = Counter(",".join(map(str, r.token_ids)) for r in results)
    assert chi_square(outcomes, exact, TRIALS)[2] < ALPHA  # the float target's law: rejected
