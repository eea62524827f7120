"""A feature draft (EAGLE: reads the target's features) in the engine, on tiny random models.

Checks: the draft's cache always equals a fresh prefill of the committed tokens with the
target's true features (so the features the engine hands over sit at the right positions, after
partial acceptances, plain steps and sessions); greedy output equals the target's for every
method; seeded output does not depend on batch-mates; the law of the first γ + 2 tokens equals
the target's exact law (chi-square); a feature draft loads from a directory, and a bad
projection is refused naming its file.
"""

from __future__ import annotations

import pytest
import torch
from harness import ALPHA
from test_engine import (
    greedy_reference,
    make_engine,
    method_grid,
    sampled_law_pvalue,
    tiny_pair,
)

from blockspec.service.requests import GenerationRequest, make_request
from blockspec.workers.draft import prefill
from blockspec.workers.llama import KVCache, Llama
from blockspec.workers.sampling import SamplingParams


def random_fc(E: int, scale: float, seed: int = 0) -> torch.Tensor:
    """[E, 2E]: [feature; embedding] -> a random projection of the feature plus the embedding.
    The features change q (so a misplaced feature changes the output law); the embedding keeps
    the draft close to the target."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([scale * torch.randn(E, E, generator=g) / E**0.5, torch.eye(E)], dim=1)


@pytest.fixture(scope="module")
def pair():
    # Small enough that greedy drafts are often accepted, far above the 1e-4 cache checks.
    return tiny_pair(vocab=48, draft_fc=random_fc(64, scale=0.1))


def fresh_draft_cache(target: Llama, draft: Llama, seq: list[int]) -> KVCache:
    """The draft's cache after a prefill of `seq` with the target's true features."""
    caches = [KVCache(m.spec, m.kv_heads, 1, 128, torch.float32, "cpu") for m in (target, draft)]
    (features,) = prefill(target, caches[0], 0, [torch.tensor(seq[:-1])])
    shifted = torch.cat([torch.zeros(1, features.shape[1]), features])
    prefill(draft, caches[1], 0, [torch.tensor(seq)], features=[shifted])
    return caches[1]


def test_draft_cache_equals_a_prefill_with_true_features(pair):
    _, target, draft = pair
    engine = make_engine(target, draft, max_batch=4)
    reqs = [
        make_request(engine.limits, [1, 2, 3], 40, "block", 1, 4, SamplingParams(), seed=3),
        make_request(
            engine.limits, [9, 8, 7, 6], 40, "traversal", 3, 3, SamplingParams(0.7), seed=4
        ),
        make_request(engine.limits, [5], 40, "none", seed=5),  # plain: the draft catches it up
    ]
    for r in reqs:
        engine.add(r)
    for _ in range(6):
        engine.step()
    for slot, active in enumerate(engine.active):
        seq = [*active.req.prompt_ids, *active.output]
        committed = seq[: len(seq) - len(active.draft_pending)]
        fresh = fresh_draft_cache(target, draft, committed)
        n = len(committed)
        assert int(engine.draft.cache.lengths[slot]) == n
        assert (engine.draft.cache.k[:, slot, :, :n] - fresh.k[:, 0, :, :n]).abs().max() < 1e-4
        assert (engine.draft.cache.v[:, slot, :, :n] - fresh.v[:, 0, :, :n]).abs().max() < 1e-4


def test_greedy_output_equals_target_greedy_for_every_method(pair):
    hf, target, draft = pair
    engine = make_engine(target, draft)
    prompts = [[3, 7, 1, 9, 2], [5]]
    refs = [greedy_reference(hf, p, 20) for p in prompts]
    requests, expected = [], []
    for method, k in method_grid():
        for prompt, ref in zip(prompts, refs, strict=True):
            greedy = SamplingParams(temperature=0.0)
            requests.append(make_request(engine.limits, prompt, 20, method, k, 3, greedy, seed=1))
            expected.append(ref)
    results = engine.generate(requests)
    for req, res, ref in zip(requests, results, expected, strict=True):
        assert res.token_ids == ref, (req.method, req.prompt_ids)
    assert max(r.stats.tokens_per_call for r in results) > 1.5  # speculation did accept


def test_seeded_output_does_not_depend_on_batch_mates(pair):
    _, target, draft = pair
    mixed = [("block", 1, 4), ("gbv", 3, 2), ("none", 1, 1), ("traversal", 2, 3)]

    def requests() -> list[GenerationRequest]:
        return [
            make_request(engine.limits, [5, 1 + i, 7], 16, m, k, g, SamplingParams(), seed=10 + i)
            for i, (m, k, g) in enumerate(mixed)
        ]

    engine = make_engine(target, draft, max_batch=len(mixed))
    alone = [engine.generate([r])[0].token_ids for r in requests()]
    assert [r.token_ids for r in engine.generate(requests())] == alone


def test_session_continuation_matches_greedy(pair):
    hf, target, draft = pair
    engine = make_engine(target, draft, max_batch=2, max_sessions=2)
    greedy = SamplingParams(temperature=0.0)
    first = [3, 7, 1, 9, 2]
    (r1,) = engine.generate(
        [make_request(engine.limits, first, 9, "block", 1, 4, greedy, session_id="s")]
    )
    turn2 = [*first, *r1.token_ids, 11, 12]
    (r2,) = engine.generate(
        [make_request(engine.limits, turn2, 10, "gbv", 2, 3, greedy, session_id="s")]
    )
    assert r2.cached_tokens > len(first)
    assert r2.token_ids == greedy_reference(hf, turn2, 10)


@pytest.mark.parametrize(
    ("method", "k"), [("token", 1), ("block", 1), ("gbv", 3), ("traversal", 2)]
)
def test_sampled_output_law_equals_target_law(method, k):
    """As test_engine's law test (same trials, α and power), with a feature draft whose
    features move q far (scale 3): 4 tokens cross an iteration boundary at γ = 2."""
    _, target, draft = tiny_pair(vocab=4, seed=5, noise=0.3, draft_fc=random_fc(64, 3.0, seed=1))
    pvalue, results = sampled_law_pvalue(target, draft, method, k)
    assert pvalue > ALPHA, f"{method}: p = {pvalue:.2e}"
    assert sum(r.stats.accepted for r in results) > 0


def test_a_feature_draft_loads_from_its_directory(tmp_path):
    from safetensors.torch import save_file
    from test_engine import save_tiny

    from blockspec.workers.models import FEATURE_FC, load_model

    save_tiny(tmp_path, vocab=16)
    save_file({"weight": torch.randn(32, 64)}, tmp_path / FEATURE_FC)
    model = load_model(tmp_path).build()
    assert model.feature_fc is not None and tuple(model.feature_fc.shape) == (32, 64)
    save_file({"weight": torch.randn(32, 32)}, tmp_path / FEATURE_FC)
    with pytest.raises(ValueError, match=FEATURE_FC):
        load_model(tmp_path)


def save_feature_draft(target_dir, out, scale: float = 0.3) -> None:
    """A 1-layer feature draft for the checkpoint in `target_dir`: its first layer, norm and
    head, reading the features through `random_fc`."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from blockspec.workers.models import FEATURE_FC

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    cfg = target.config
    cfg.num_hidden_layers = 1
    draft = LlamaForCausalLM(cfg)
    draft.load_state_dict(target.state_dict(), strict=False)  # layer 0, embeddings, norm, head
    draft.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out / name)
    save_file({"weight": random_fc(cfg.hidden_size, scale)}, out / FEATURE_FC)


def test_a_feature_draft_must_match_the_targets_width(tmp_path):
    import shutil

    from blockspec.workers.models import FEATURE_FC, TINY_DRAFT, TINY_TARGET, check_pair

    shutil.copytree(TINY_DRAFT, tmp_path / "draft")  # hidden 128; the tiny target's is 256
    (tmp_path / "draft" / FEATURE_FC).write_bytes(b"")
    with pytest.raises(ValueError, match="hidden_size 256"):
        check_pair(tmp_path / "draft", TINY_TARGET)
