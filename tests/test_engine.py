"""The in-process speculative engine on tiny real Llama models (random weights, real code paths).

Checks: our Llama forward equals Hugging Face's; the tree forward equals per-path forwards; the
KV cache after commits equals a fresh prefill of the accepted sequence; at temperature 0 every
method reproduces the target's greedy decoding, in mixed batches of different prompts and
methods; at temperature > 0 the law of the first generated tokens equals the target's exact law
(chi-square); stop tokens and max_new_tokens; a pair with different vocabularies is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import Counter

import pytest
import torch
from harness import ALPHA, chi_square
from transformers import LlamaConfig, LlamaForCausalLM

from blockspec.service.engine import SpeculativeEngine
from blockspec.service.policy import PLAIN
from blockspec.service.requests import GenerationRequest, InvalidArgument, make_request
from blockspec.verification import METHODS, VERIFIERS, CounterDraws, verify
from blockspec.verification.tensors import gather_rows, rows_at
from blockspec.workers.draft import padding_groups, prefill
from blockspec.workers.llama import KVCache, Llama, LlamaSpec
from blockspec.workers.proposers import build_proposer
from blockspec.workers.sampling import SamplingParams, sample, verify_key
from blockspec.workers.speculation import SpeculationCache
from blockspec.workers.step import StepRunner, VerifyPlan, verify_step
from blockspec.workers.target import TargetWorker
from blockspec.workers.tree import build_tree


def tiny_config(vocab: int, **overrides) -> LlamaConfig:
    """The tiny random pairs' 2-layer Llama shape (hidden 64)."""
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=256,
        initializer_range=0.5,  # peaked, varied conditionals (0.02 gives near-uniform rows)
        eos_token_id=None,
        **overrides,
    )


def tiny_pair(
    vocab: int,
    seed: int = 0,
    noise: float = 0.05,
    draft_fc: torch.Tensor | None = None,
    draft_head: list[int] | None = None,
):
    """A random target and a draft that is a perturbed copy (acceptance well inside (0, 1));
    with `draft_fc` [64, 128], a feature draft reading the target's features through it; with
    `draft_head` (sorted ids), a draft whose output head keeps only those ids."""
    torch.manual_seed(seed)
    cfg = tiny_config(vocab)
    hf = LlamaForCausalLM(cfg).eval()
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    draft_state = {k: v + noise * torch.randn_like(v) for k, v in state.items()}
    spec = LlamaSpec.from_hf_config(cfg)
    head = None if draft_head is None else torch.tensor(draft_head)
    return hf, Llama(spec, state), Llama(spec, draft_state, feature_fc=draft_fc, head_vocab=head)


def make_engine(
    target: Llama,
    draft: Llama,
    max_batch: int = 16,
    max_len: int = 128,
    max_sessions: int = 0,
    speculation: SpeculationCache | None = None,
):
    slots = max_batch + max_sessions
    proposer = build_proposer(draft, slots, max_len)
    return SpeculativeEngine(
        StepRunner(TargetWorker(target, slots, max_len), proposer, speculation),
        max_batch,
        max_len,
        target.spec.vocab_size,
        max_sessions,
    )


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=48)


def test_llama_matches_hugging_face(pair):
    hf, target, _ = pair
    seq = torch.randint(0, 48, (1, 20), generator=torch.Generator().manual_seed(1))
    ref = hf(seq).logits[0]
    cache = KVCache(target.spec, target.kv_heads, 1, 64, torch.float32, "cpu")
    mask = torch.ones(12, 12, dtype=torch.bool).tril()
    logits, k, v, _ = target(
        seq[:, None, :12], torch.arange(12)[None, None], cache, mask[None, None]
    )
    cache.append(k[:, :, 0], v[:, :, 0], torch.arange(12)[None], torch.tensor([12]))
    rest, *_ = target(
        seq[:, None, 12:], torch.arange(12, 20)[None, None], cache, mask[None, None, :8, :8]
    )
    assert torch.allclose(logits[0, 0], ref[:12], atol=1e-4)
    assert torch.allclose(rest[0, 0], ref[12:], atol=1e-4)


def test_gather_rows_equals_advanced_indexing():
    """gather_rows (path rows out of node rows, take_rows in the verifiers) gives what
    rows[arange(B), index] gives: index of any shape, and rows whose B and L dims do not merge
    (a slice of a larger tensor), which take the advanced-indexing fallback."""
    g = torch.Generator().manual_seed(3)
    whole = torch.rand(4, 3, 6, 5, generator=g)
    for rows in (whole[:, 0], whole[:, :, 0]):  # mergeable [4, 6, 5], not mergeable [4, 3, 5]
        L = rows.shape[1]
        for shape in ((4,), (4, 2, 3)):
            index = torch.randint(0, L, shape, generator=g)
            arange = torch.arange(4).view(4, *[1] * (len(shape) - 1))
            assert torch.equal(gather_rows(rows, index), rows[arange, index]), (rows.shape, shape)
    # rows_at: (request, path, depth) triples for a subset of requests, contiguous or not
    for rows in (whole, whole.transpose(1, 2)):
        b, k, d = torch.tensor([3, 0, 3]), torch.tensor([1, 2, 0]), torch.tensor([4, 0, 2])
        _, K, D, _ = rows.shape
        assert torch.equal(rows_at(rows, b, k % K, d % D), rows[b, k % K, d % D])
        assert torch.equal(rows_at(rows, b, 0, 1), rows[b, 0, 1])


def test_tree_forward_equals_per_path_forwards(pair):
    _, target, _ = pair
    gen = torch.Generator().manual_seed(2)
    contexts = [torch.randint(0, 48, (n,), generator=gen) for n in (5, 9)]
    worker = TargetWorker(target, 2, 64)
    worker.prefill(0, contexts)
    paths = torch.randint(0, 48, (2, 3, 4), generator=gen)
    paths[:, 1, :2] = paths[:, 0, :2]  # shared prefixes merge into one node
    root = torch.tensor([7, 11])
    tree = build_tree(root, paths, torch.tensor([3, 2]), torch.tensor([4, 3]))
    logits = worker.score_logits(tree)  # [2, N, V]
    for b, (k_used, depth) in enumerate([(3, 4), (2, 3)]):
        for k in range(k_used):
            chain = torch.cat([torch.cat([contexts[b], root[b : b + 1]]), paths[b, k, :depth]])
            ref = LlamaRef(target)(chain)[len(contexts[b]) :]  # rows after root and path tokens
            got = logits[b, tree.node_of[b, k, : depth + 1]]
            assert torch.allclose(got, ref, atol=1e-4), (b, k)


class LlamaRef:
    """Plain full-sequence forward of our Llama (a fresh cache per call)."""

    def __init__(self, model: Llama, dtype: torch.dtype = torch.float32):  # the cache's
        self.model, self.dtype = model, dtype

    def __call__(self, seq: torch.Tensor) -> torch.Tensor:
        T = seq.shape[0]
        cache = KVCache(self.model.spec, self.model.kv_heads, 1, T + 1, self.dtype, "cpu")
        mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
        return self.model(seq[None, None], torch.arange(T)[None, None], cache, mask)[0][0, 0]


def greedy_reference(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def method_grid():
    for method in (*METHODS, "none"):
        single = method == "none" or VERIFIERS[method].single_path
        yield method, 1 if single else 3


def test_greedy_output_equals_target_greedy_for_every_method(pair):
    hf, target, draft = pair
    engine = make_engine(target, draft)
    prompts = [[3, 7, 1, 9, 2], [5], [40, 41, 42, 43, 44, 45, 46, 1, 2, 3, 4]]
    refs = [greedy_reference(hf, p, 24) for p in prompts]
    requests, expected = [], []
    for (method, k), (prompt, ref) in itertools.product(
        method_grid(), zip(prompts, refs, strict=True)
    ):
        requests.append(
            make_request(
                engine.limits, prompt, 24, method, k, 3, SamplingParams(temperature=0.0), seed=1
            )
        )
        expected.append(ref)
    results = engine.generate(requests)  # 30 requests, max_batch 16: continuous batching
    for req, res, ref in zip(requests, results, expected, strict=True):
        assert res.token_ids == ref, (req.method, req.prompt_ids)
        assert res.finish_reason == "length"
    spec_results = [r for q, r in zip(requests, results, strict=True) if q.method != "none"]
    assert max(r.stats.tokens_per_call for r in spec_results) > 1.5  # speculation did accept


def test_kv_cache_equals_fresh_prefill_after_commits(pair):
    _, target, draft = pair
    engine = make_engine(target, draft, max_batch=4)
    reqs = [
        make_request(engine.limits, [1, 2, 3], 40, "spectr_gbv", 2, 4, SamplingParams(), seed=3),
        make_request(
            engine.limits,
            [9, 8, 7, 6, 5, 4],
            40,
            "traversal",
            3,
            3,
            SamplingParams(0.7, top_k=10),
            seed=4,
        ),
    ]
    for r in reqs:
        engine.add(r)
    for _ in range(5):
        engine.step()
    for slot, active in enumerate(engine.active):
        committed = [*active.req.prompt_ids, *active.output[:-1]]  # all but the pending last token
        for worker, pending in ((engine.target, 1), (engine.draft, len(active.draft_pending))):
            seq = [*active.req.prompt_ids, *active.output][: len(committed) + 1 - pending]
            fresh = KVCache(worker.model.spec, worker.model.kv_heads, 1, 128, torch.float32, "cpu")
            prefill(worker.model, fresh, 0, [torch.tensor(seq)])
            n = len(seq)
            assert int(worker.cache.lengths[slot]) == n
            diff = (worker.cache.k[:, slot, :, :n] - fresh.k[:, 0, :, :n]).abs().max()
            assert diff < 1e-4, float(diff)
            assert (worker.cache.v[:, slot, :, :n] - fresh.v[:, 0, :, :n]).abs().max() < 1e-4


@pytest.mark.parametrize(
    "kinds",
    [["spectr_gbv"] * 4, ["spectr_gbv", "block", "spectr_gbv", PLAIN, "block"]],
    ids=["one-kind", "interleaved"],
)
def test_verify_step_verifies_each_group_on_its_own_rows(kinds):
    """verify_step takes consecutive rows as views (workers.step.group_rows) and gathers interleaved
    ones: every request emits what a direct verify of its group's rows, with the same
    per-request counter keys, emits (a plain request: the sampler's draw from its root row)."""
    vocab, shape = 40, {"spectr_gbv": (3, 4), "block": (1, 2), PLAIN: (1, 1)}
    n, k_max, g_max = len(kinds), 3, 4
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(n, k_max, g_max, vocab, generator=gen).softmax(-1)
    p = torch.randn(n, k_max, g_max + 1, vocab, generator=gen).softmax(-1)
    x = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(n, k_max, g_max)
    groups = {}
    for i, kind in enumerate(kinds):
        groups.setdefault((kind, *shape[kind]), []).append(i)
    draws = torch.tensor([[verify_key(100 + i), 50 + i] for i in range(n)])
    plan = VerifyPlan([(*key, idx) for key, idx in groups.items()], [None] * n, g_max, draws)

    verdict = verify_step(plan, x, q, p)
    for (method, k, gamma), idx in groups.items():
        if method == PLAIN:
            for i in idx:
                expected = sample(p[i : i + 1, :1, 0], draws[i : i + 1])[0, 0]
                assert verdict.tokens[i, 0] == expected and verdict.num_accepted[i] == 0
            continue
        rows = torch.tensor(idx)
        out = verify(
            method, x[rows, :k, :gamma], q[rows, :k, :gamma], p[rows, :k, : gamma + 1],
            CounterDraws(draws[rows]),
        )  # fmt: skip
        assert torch.equal(verdict.tokens[rows, : gamma + 1], out.tokens)
        assert torch.equal(verdict.num_accepted[rows], out.num_accepted)
        assert torch.equal(verdict.path[rows], out.path)
        assert all(verdict.carries[i] is not None for i in idx) == (method == "spectr_gbv")


def test_padding_groups_bound_the_padding():
    assert padding_groups([]) == []
    assert padding_groups([7]) == [(0, 1)]
    # 8 x 199 padded for 1436 tokens: within 25%, one batch
    assert padding_groups([199, 164, 199, 166, 199, 124, 199, 186]) == [(0, 8)]
    assert padding_groups([100, 400, 120, 390, 0, 0]) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 6)]
    for lengths in ([3, 9, 9, 2, 50, 48, 47, 1], [5] * 6, [0, 4, 4]):
        groups = padding_groups(lengths)
        assert [lo for lo, _ in groups[1:]] == [hi for _, hi in groups[:-1]]  # consecutive, all
        assert groups[0][0] == 0 and groups[-1][1] == len(lengths)
        for lo, hi in groups:
            run = lengths[lo:hi]
            assert len(run) == 1 or len(run) * max(run) <= 1.25 * sum(run)


def test_grouped_prefill_equals_one_context_at_a_time(pair):
    """Contexts of very different lengths (and one slot keeping a warm prefix) prefill in
    several padded batches: every slot's cache and features equal a prefill of it alone."""
    _, target, _ = pair
    gen = torch.Generator().manual_seed(5)
    lengths, keep = [30, 4, 28, 0, 9], [0, 0, 6, 0, 0]
    warm = torch.randint(0, 48, (6,), generator=gen)
    contexts = [torch.randint(0, 48, (n,), generator=gen) for n in lengths]
    assert len(padding_groups(lengths)) > 1
    batched = KVCache(target.spec, target.kv_heads, 5, 64, torch.float32, "cpu")
    prefill(target, batched, 2, [warm])
    feats = prefill(target, batched, 0, contexts, keep)
    for i, (context, kept) in enumerate(zip(contexts, keep, strict=True)):
        alone = KVCache(target.spec, target.kv_heads, 1, 64, torch.float32, "cpu")
        full = torch.cat([warm[:kept], context])
        ref = prefill(target, alone, 0, [full])[0][kept:]
        n = len(full)
        assert int(batched.lengths[i]) == n
        assert torch.allclose(batched.k[:, i, :, :n], alone.k[:, 0, :, :n], atol=1e-5)
        assert torch.allclose(batched.v[:, i, :, :n], alone.v[:, 0, :, :n], atol=1e-5)
        assert torch.allclose(feats[i], ref, atol=1e-5)


def test_stop_tokens_and_max_new_tokens(pair):
    hf, target, draft = pair
    engine = make_engine(target, draft)
    ref = greedy_reference(hf, [3, 7, 1], 12)
    stop = ref[5]
    first = ref.index(stop)
    reqs = [
        make_request(
            engine.limits, [3, 7, 1], 12, "block", 1, 4, SamplingParams(0.0), stop_token_ids=(stop,)
        ),
        make_request(engine.limits, [3, 7, 1], 7, "gbv", 2, 4, SamplingParams(0.0)),
    ]
    stopped, capped = engine.generate(reqs)
    assert stopped.finish_reason == "stop" and stopped.token_ids == ref[: first + 1]
    assert capped.finish_reason == "length" and capped.token_ids == ref[:7]


def test_bad_requests_are_refused_with_the_field_named(pair):
    _, target, draft = pair
    engine = make_engine(target, draft, max_len=64)
    cases = {
        "method": dict(prompt_ids=[1], method="nope"),
        "prompt": dict(prompt_ids=[]),
        "k": dict(prompt_ids=[1], method="block", k=2),
        "max_new_tokens": dict(prompt_ids=[1], max_new_tokens=0),
        "prompt_token_ids": dict(prompt_ids=[1, engine.vocab_size], max_new_tokens=8),
    }
    for field, fields in cases.items():
        with pytest.raises(InvalidArgument) as refused:
            make_request(engine.limits, **fields)
        assert refused.value.field == field
    with pytest.raises(InvalidArgument, match="context"):
        make_request(engine.limits, list(range(40)), max_new_tokens=30)


def exact_target_law(
    target: Llama, prompt: list[int], length: int, vocab: int, dtype=torch.float32
) -> dict[str, float]:
    """Law of the first `length` generated tokens at temperature 1, by enumerating all prefixes
    (`dtype`: the model's activations and cache)."""
    law = {"": 1.0}
    for _ in range(length):
        nxt = {}
        for key, prob in law.items():
            seq = prompt + ([int(t) for t in key.split(",")] if key else [])
            row = LlamaRef(target, dtype)(torch.tensor(seq))[-1].float().softmax(-1)
            for tok in range(vocab):
                nxt[f"{key},{tok}" if key else str(tok)] = prob * float(row[tok])
        law = nxt
    return law


@pytest.mark.parametrize(
    ("method", "k"), [("block", 1), ("spectr_gbv", 2), ("gbv", 3), ("traversal", 2)]
)
def test_sampled_output_law_equals_target_law(method, k):
    """Engine-level losslessness: L = γ + 2 tokens cross an iteration boundary (and, for
    spectr_gbv, exercise the carried target modification)."""
    _, target, draft = tiny_pair(vocab=4, seed=5, noise=0.3)
    pvalue, _ = sampled_law_pvalue(target, draft, method, k)
    assert pvalue > ALPHA, f"{method}: p = {pvalue:.2e}"


@pytest.mark.parametrize(("method", "k"), [("token", 1), ("gbv", 2)])
def test_sampled_output_law_with_a_reduced_draft_head(method, k):
    """The draft samples on its head's ids ([0, 1, 3] of 4) and widens q with zeros: the
    output still has the target's law, token 2 (never drafted) included."""
    _, target, draft = tiny_pair(vocab=4, seed=5, noise=0.3, draft_head=[0, 1, 3])
    pvalue, results = sampled_law_pvalue(target, draft, method, k)
    assert pvalue > ALPHA, f"{method}: p = {pvalue:.2e}"
    assert any(2 in r.token_ids for r in results) and sum(r.stats.accepted for r in results) > 0


def test_a_reduced_head_draft_proposes_on_its_ids():
    """Draft tokens come from the head's ids; q is the row on those ids, widened with zeros
    (whole_vocab=False, what the draft actor sends, is the same row unwidened)."""
    kept = sorted(torch.randperm(48, generator=torch.Generator().manual_seed(3))[:20].tolist())
    _, _, draft = tiny_pair(vocab=48, draft_head=kept)
    worker = build_proposer(draft, 2, 64)
    worker.prefill(0, [torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
    args = (torch.tensor([[7, 0], [8, 9]]), torch.tensor([1, 2]), [2, 3], [3, 2])
    params = [SamplingParams(1.0), SamplingParams(0.7, top_k=5)]

    def propose(whole_vocab: bool):
        lengths = worker.cache.lengths.clone()
        draws = torch.tensor([[1, 3], [2, 2]])  # (draft key, root position) per request
        out = worker.propose(*args, params, draws, whole_vocab=whole_vocab)
        worker.cache.lengths.copy_(lengths)  # propose appended the pending tokens: undo
        return out

    x, q = propose(whole_vocab=True)
    x_h, q_h = propose(whole_vocab=False)
    assert torch.equal(x, x_h) and q.shape[-1] == 48 and q_h.shape[-1] == len(kept)
    assert torch.isin(x[0, :2, :3], torch.tensor(kept)).all()  # the entries request 0 drew
    assert torch.isin(x[1, :3, :2], torch.tensor(kept)).all()
    assert torch.equal(q[..., kept], q_h) and (q.index_fill(-1, torch.tensor(kept), 0) == 0).all()
    drawn = q.gather(-1, x.unsqueeze(-1))[0, :2, :3]
    assert (drawn > 0).all()  # each token has mass in the row it was drawn from


def sampled_law_pvalue(target, draft, method: str, k: int, trials: int = 12_000):
    """Chi-square p-value of `trials` seeded requests' outputs (prompt [1, 3, 0], 4 tokens,
    γ = 2: they cross an iteration boundary) against the target's exact law; and the results."""
    gamma, length, prompt = 2, 4, [1, 3, 0]
    law = exact_target_law(target, prompt, length, target.spec.vocab_size)
    engine = make_engine(target, draft, max_batch=trials, max_len=16)
    return engine_law_pvalue(engine, law, prompt, gamma, method, k, trials)


def engine_law_pvalue(
    engine, law: dict[str, float], prompt: list[int], gamma: int, method: str, k: int, trials: int
):
    """Chi-square p-value of `trials` seeded requests (T = 1, as many tokens as the law's
    outcomes have) through `engine` against `law`; and the results."""
    length = len(next(iter(law)).split(","))
    reqs = [
        make_request(engine.limits, prompt, length, method, k, gamma, SamplingParams(), seed=i)
        for i in range(trials)
    ]
    results = engine.generate(reqs)
    outcomes = Counter(",".join(map(str, r.token_ids)) for r in results)
    return chi_square(outcomes, law, trials)[2], results


def save_tiny(path, vocab: int, context: int = 2048) -> None:
    """A tiny random Llama checkpoint with a word-level tokenizer, loadable offline."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=vocab,
        max_position_embeddings=context,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)


def test_mismatched_vocabularies_are_refused(tmp_path):
    from blockspec.workers.models import check_pair, load_pair

    save_tiny(tmp_path / "draft", 40)
    save_tiny(tmp_path / "target", 48)
    for load in (load_pair, check_pair):  # in-process engine; replicas (no weights loaded)
        with pytest.raises(ValueError, match="vocabulary"):
            load(tmp_path / "draft", tmp_path / "target")


def test_missing_model_directories_say_what_to_set(tmp_path):
    from blockspec.workers.models import DEFAULT_TARGET, load_model

    with pytest.raises(ValueError, match=r"has no config\.json$"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"scripts/setup\.sh"):
        load_model(DEFAULT_TARGET.parent / "not-converted")  # the default pair before set-up


def test_engine_context_is_capped_at_the_models_context(tmp_path):
    from blockspec.service.build import build_engine

    save_tiny(tmp_path / "draft", 40, context=96)
    save_tiny(tmp_path / "target", 40, context=64)
    engine, _ = build_engine(str(tmp_path / "draft"), str(tmp_path / "target"), max_len=1024)
    assert engine.max_len == 64
    with pytest.raises(InvalidArgument, match="context"):
        make_request(engine.limits, list(range(30)), max_new_tokens=30, gamma=4)


# Every method with its own K and γ (and plain decoding), as batch-mates of one another.
MIXED = [
    ("none", 1, 1),
    ("token", 1, 2),
    ("block", 1, 2),
    ("greedy_block", 1, 5),
    ("naive", 2, 3),
    ("specinfer", 3, 2),
    ("spectr", 2, 4),
    ("gbv", 3, 4),
    ("traversal", 3, 4),
    ("spectr_gbv", 2, 3),
]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_seeded_output_does_not_depend_on_batch_mates(pair, temperature):
    """A seeded request writes the same tokens alone and in a batch that mixes every method,
    K and γ (a request draws random numbers only for its own paths and depths)."""
    _, target, draft = pair
    sampling = SamplingParams(temperature, top_k=20 if temperature < 1 else 0)

    def requests(seed: int) -> list[GenerationRequest]:
        return [
            make_request(engine.limits, [5, 1 + i, 7, 3], 16, m, k, g, sampling, seed=seed + i)
            for i, (m, k, g) in enumerate(MIXED)
        ]

    engine = make_engine(target, draft, max_batch=len(MIXED))
    for seed in (0, 100, 200):
        alone = [engine.generate([r])[0].token_ids for r in requests(seed)]
        together = [r.token_ids for r in engine.generate(requests(seed))]
        backwards = [r.token_ids for r in engine.generate(requests(seed)[::-1])]
        assert together == alone and backwards == alone[::-1], seed


def test_plain_requests_skip_the_draft_and_catch_up_in_a_mixed_batch(pair):
    hf, target, draft = pair
    engine = make_engine(target, draft)
    prompt = [3, 7, 1, 9, 2]
    ref = greedy_reference(hf, prompt, 20)
    greedy = SamplingParams(temperature=0.0)
    engine.add(make_request(engine.limits, prompt, 20, "none", sampling=greedy), "plain")
    for _ in range(4):  # a batch of plain requests only: the draft model does not run
        engine.step()
    # The draft cache still holds only the prefilled context; 1 + 4 tokens wait for it.
    assert int(engine.draft.cache.lengths[0]) == 4 and len(engine.active[0].draft_pending) == 5
    engine.add(make_request(engine.limits, prompt, 20, "block", 1, 4, greedy), "spec")
    results = {}
    while engine.active or engine.waiting:
        results.update({r.request_id: r for r in engine.step().finished})
    assert results["plain"].token_ids == ref and results["spec"].token_ids == ref


def test_session_continuation_reuses_parked_kv_and_matches_greedy(pair):
    hf, target, draft = pair
    engine = make_engine(target, draft, max_batch=2, max_sessions=2)
    greedy = SamplingParams(temperature=0.0)
    first = [3, 7, 1, 9, 2]
    stop = greedy_reference(hf, first, 12)[7]  # stops mid-block: KV past the stop is dropped
    req = make_request(
        engine.limits, first, 12, "block", 1, 4, greedy, stop_token_ids=(stop,), session_id="s"
    )
    (r1,) = engine.generate([req])
    assert r1.finish_reason == "stop" and r1.cached_tokens == 0  # nothing parked yet
    history = first + r1.token_ids
    turn2 = [*history, 11, 12]
    # A second session fills the other parked slot; a third evicts the oldest ("s" is reused
    # first, so it is the newest).
    (r2,) = engine.generate(
        [make_request(engine.limits, turn2, 10, "gbv", 2, 3, greedy, session_id="s")]
    )
    # Only the new tokens ran (and the last history token, if the stop ended a block).
    assert r2.cached_tokens in (len(history) - 1, len(history))
    assert r2.token_ids == greedy_reference(hf, turn2, 10)
    # The parked KV equals a fresh prefill of the session's history.
    parked = engine.parking.entries["s"]
    seq = turn2 + r2.token_ids
    assert parked.tokens == seq
    fresh = KVCache(target.spec, target.kv_heads, 1, 128, torch.float32, "cpu")
    prefill(target, fresh, 0, [torch.tensor(seq[: parked.target_len])])
    n = parked.target_len
    diff = (engine.target.cache.k[:, parked.slot, :, :n] - fresh.k[:, 0, :, :n]).abs().max()
    assert diff < 1e-4
    # An edited history reuses only the common prefix, and the output is still exact.
    edited = [*seq[:4], 30, 31]
    (r3,) = engine.generate(
        [make_request(engine.limits, edited, 6, "token", 1, 2, greedy, session_id="s")]
    )
    assert r3.cached_tokens == 4
    assert r3.token_ids == greedy_reference(hf, edited, 6)
    # Eviction: capacity 2, three sessions; the least recently parked one starts cold.
    for sid in ("a", "b"):
        engine.generate(
            [make_request(engine.limits, [5, 6], 3, "block", 1, 2, greedy, session_id=sid)]
        )
    assert list(engine.parking.entries) == ["a", "b"] and len(engine.parking.free_slots) == 0
    (r4,) = engine.generate(
        [make_request(engine.limits, edited, 4, "block", 1, 2, greedy, session_id="s")]
    )
    assert r4.cached_tokens == 0 and r4.token_ids == greedy_reference(hf, edited, 4)


def test_cancel_frees_the_slot_and_streaming_reports_every_token(pair):
    hf, target, draft = pair
    engine = make_engine(target, draft, max_batch=2)
    greedy = SamplingParams(temperature=0.0)
    progress: list = []
    bare: list = []  # the stream of a request without stop strings: no stats
    request = functools.partial(make_request, engine.limits, max_new_tokens=20, sampling=greedy)
    stops = dataclasses.replace(
        request([4, 5, 6], method="traversal", k=2, gamma=3), stop=("never said",)
    )
    engine.add(stops, on_tokens=progress.append)
    gone = engine.add(request([7, 8], method="block", k=1, gamma=3), on_tokens=bare.append)
    waiting = engine.add(request([9], method="block", k=1, gamma=3))
    engine.step()
    assert len(engine.active) == 2 and len(engine.waiting) == 1
    assert engine.cancel(gone) and engine.cancel(waiting)
    assert not engine.cancel(gone)
    assert len(engine.active) == 1 and not engine.waiting
    results = []
    while engine.active:
        results += engine.step().finished
    (res,) = results
    streamed = [token for step in progress for token in step.token_ids]
    assert res.token_ids == greedy_reference(hf, [4, 5, 6], 20) == streamed
    # Each step's progress carries the stats as they stood after it, the last as the result's.
    assert [p.stats.target_calls for p in progress] == list(range(1, len(progress) + 1))
    assert progress[-1].stats == res.stats and progress[0].stats is not res.stats
    assert len(bare) == 1 and bare[0].token_ids and bare[0].stats is None
