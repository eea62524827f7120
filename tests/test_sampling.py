"""Processed distributions (spec §0.1): the rows both the draft samples from and verifiers see."""

import dataclasses

import numpy as np
import pytest
import torch

from blockspec.verification import CounterDraws
from blockspec.verification.common import draw_uniforms
from blockspec.verification.tensors import chunked_cumsum64, sample_from_weights
from blockspec.workers.sampling import (
    SamplingParams,
    apply_law,
    draft_key,
    draft_uniforms,
    law_of,
    process,
    sample,
    splitmix64,
    verify_key,
)

LOGITS = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))


def test_each_row_gets_its_own_settings():
    logits = LOGITS.expand(5, 4)
    params = [
        SamplingParams(1.0),
        SamplingParams(0.5),
        SamplingParams(1.0, top_k=2),
        SamplingParams(1.0, top_p=0.6),  # 0.4 alone is < 0.6; with 0.3 it reaches 0.7
        SamplingParams(0.0),
    ]
    out = process(logits, params)
    p = torch.tensor([0.1, 0.4, 0.2, 0.3])
    assert torch.allclose(out[0], p)
    assert torch.allclose(out[1], p**2 / (p**2).sum())
    assert torch.allclose(out[2], torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    assert torch.allclose(out[3], torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    assert torch.equal(out[4], torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_greedy_ties_go_to_the_lowest_id_and_extra_dims_are_kept():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]]])  # [n=1, R=2, V]
    out = process(logits, [SamplingParams(0.0)])
    assert out.shape == logits.shape
    assert torch.equal(out[0].argmax(-1), torch.tensor([1, 0]))
    assert torch.equal(out.sum(-1), torch.ones(1, 2))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -1.0}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p")],
)
def test_bad_settings_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def hf_process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Hugging Face's warpers in `generate`'s order: temperature, top-k, top-p."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits.clone()
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores.softmax(-1)


def test_top_k_then_top_p_renormalises_like_hugging_face():
    """The issue's example: top-k keeps .5/.3, renormalised to .625/.375; top_p = 0.6 then keeps
    the first alone (HF), not both (top-p over the full softmax)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]]))
    params = SamplingParams(1.0, top_k=2, top_p=0.6)
    assert torch.equal(process(logits, [params]), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(hf_process(logits, params), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("ties", [False, True])
def test_processing_equals_hugging_face_on_random_rows(ties):
    """Random rows (ties: logits drawn from 6 values, so the top-k and top-p boundaries cut
    through runs of equal logits), every combination of settings, top_p near 0 and 1."""
    gen = torch.Generator().manual_seed(7)
    rows, vocab = 64, 50
    if ties:
        logits = torch.randint(0, 6, (rows, vocab), generator=gen).float() / 2
    else:
        logits = 3 * torch.randn(rows, vocab, generator=gen)
    settings = [
        SamplingParams(t, k, p)
        for t in (1.0, 0.7, 1.3)
        for k in (0, 1, 3, 10, 49, 50)
        for p in (1.0, 0.9, 0.5, 1e-6, 0.999999)
    ]
    for params in settings:
        ours = process(logits, [params] * rows)
        theirs = hf_process(logits, params)
        assert torch.equal(ours > 0, theirs > 0), params  # the same kept tokens
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7, msg=str(params))


def test_a_reduced_head_processes_alike_on_its_own_ids():
    """A draft with a reduced head (draft_vocab.json) processes and samples its rows on the
    head's ids only: every setting keeps the same tokens, with the same probabilities, as on
    the whole vocabulary with -inf at the dropped ids (greedy ties included: ids stay sorted)."""
    gen = torch.Generator().manual_seed(8)
    rows, vocab = 32, 60
    kept = torch.randperm(vocab, generator=gen)[:25].sort().values
    logits = 3 * torch.randn(rows, len(kept), generator=gen)
    logits[0, :2] = logits[0].max() + 1  # a greedy tie: the lower kept id wins on both
    whole = torch.full((rows, vocab), -torch.inf).index_copy_(-1, kept, logits)
    for params in [
        SamplingParams(t, k, p)
        for t in (0.0, 1.0, 0.7)
        for k in (0, 3, 25, 40)
        for p in (1.0, 0.9, 1e-6)
    ]:
        reduced = process(logits, [params] * rows)
        widened = process(whole, [params] * rows)
        assert (widened.index_fill(-1, kept, 0) == 0).all(), params
        # Which of tied top logits top-p keeps is the sort's choice (module docstring), and a
        # different row length may sort them differently: row 0's tie is checked without it.
        rows_checked = slice(None) if params.top_p == 1 else slice(1, None)
        torch.testing.assert_close(
            reduced[rows_checked], widened[rows_checked][:, kept], rtol=1e-5, atol=1e-7,
            msg=str(params),
        )  # fmt: skip


def test_a_row_is_processed_alike_whatever_its_batch_mates_ask():
    """process skips the steps no request of the batch asks for; a row's probabilities must
    not depend on that: every row of a mixed batch equals the row processed alone, bit for bit
    (seeded output is independent of batch-mates), and the logits are left as they were."""
    gen = torch.Generator().manual_seed(9)
    settings = [
        SamplingParams(t, k, p) for t in (0.0, 1.0, 0.7) for k in (0, 3, 60) for p in (1.0, 0.9)
    ]
    logits = 3 * torch.randn(len(settings), 2, 50, generator=gen)  # [n, R, V]
    before = logits.clone()
    batch = process(logits, settings)
    assert torch.equal(logits, before)
    for i, params in enumerate(settings):
        assert torch.equal(batch[i], process(logits[i : i + 1], [params])[0]), params


def test_top_k_widths_share_a_power_of_two_and_give_each_row_its_own_k():
    """A law's topk width is the batch's largest top-k rounded up to a power of two (at most
    V): the draft's proposal graph is keyed by it, so top-k 40 and 50 replay one graph, and a
    row's probabilities are the same bits as with the exact width."""
    gen = torch.Generator().manual_seed(3)
    logits = 2 * torch.randn(3, 2, 100, generator=gen)
    logits[0, 0, :10] = logits[0, 0, 40]  # ties with the 40th value: every tie stays
    params = [SamplingParams(1.0, 40), SamplingParams(0.7, 50), SamplingParams(1.0, 3)]
    law = law_of(params, 100, logits.device)
    forty, fifty = (law_of([SamplingParams(1.0, k)], 100, logits.device) for k in (40, 50))
    assert law.max_k == 64 and forty.steps == fifty.steps
    assert law_of([SamplingParams(1.0, 90)], 100, logits.device).max_k == 100  # at most V
    exact = dataclasses.replace(law, max_k=50)
    assert torch.equal(apply_law(logits, law), apply_law(logits, exact))


@pytest.mark.parametrize("vocab", [256, 1000, 49152])
def test_chunked_running_sums_equal_one_scan(vocab):
    """The accelerators' chunked scan (verification.tensors.cumsum64): every running sum equals
    the sequential float64 scan's to rounding, also on a ragged last chunk and on rows that mix
    magnitudes 1e-30..1, and stays non-decreasing, so the inverse-CDF sampler picks the same
    tokens."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.rand(6, vocab, generator=gen)
    rows[3:] = rows[3:] * 10.0 ** -torch.randint(0, 30, (3, vocab), generator=gen)
    rows[5, ::7] = 0
    sequential = rows.cumsum(-1, dtype=torch.float64)
    chunked = chunked_cumsum64(rows, 256)
    assert chunked.shape == sequential.shape
    assert torch.allclose(chunked, sequential, rtol=1e-13, atol=0)
    assert (chunked.diff(dim=-1) >= 0).all()
    u = torch.rand(6, generator=gen, dtype=torch.float64)
    weights = rows.double()
    picked = torch.searchsorted(chunked.contiguous(), (u * chunked[:, -1])[:, None], right=True)
    assert torch.equal(picked.squeeze(-1), sample_from_weights(weights, u))


# ------------------------------------------------------------ counter-based draft uniforms
def _splitmix64_reference(state: int) -> int:
    """splitmix64's output for `state`, in Python integers (Vigna's reference, mod 2^64)."""
    mask = (1 << 64) - 1
    z = (state + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_splitmix64_equals_the_reference():
    """numpy's uint64 ops wrap and shift like the reference, over the whole 64-bit range."""
    states = [0, 1, 12345, (1 << 63) - 1, 1 << 62, 0xDEADBEEF << 20, 1 << 63, (1 << 64) - 1]
    got = splitmix64(np.array(states, dtype=np.uint64)).tolist()
    assert got == list(map(_splitmix64_reference, states))


def test_draft_uniforms_are_uniform_and_keyed_by_every_coordinate():
    """u[i, path, depth] depends on (key, root, path, depth) only: the same key and root give
    the same bits in any batch; another root, path, depth or key gives fresh ones; and the
    values pass a chi-square test of uniformity (64 bins, 2^16 draws; p > 1e-4)."""
    keys = torch.tensor([draft_key(s) for s in range(256)])
    draws = torch.stack([keys, torch.full_like(keys, 17)], dim=1)  # [256, 2]
    u = draft_uniforms(draws, 4, 64)  # [256, 4, 64]
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(draft_uniforms(draws[5:7], 2, 3), u[5:7, :2, :3])  # batch-independent
    moved = draft_uniforms(draws + torch.tensor([0, 1]), 4, 64)  # the next root position
    assert not bool((moved == u).any())
    assert u.flatten().unique().numel() == u.numel()  # no repeat over paths, depths, keys
    counts = torch.histc(u.flatten().float(), bins=64, min=0.0, max=1.0)
    expected = u.numel() / 64
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert statistic < 123.0  # chi-square, 63 dof: P(X > 123) ≈ 1e-5


def test_draft_keys_differ_by_seed_and_stay_in_int64():
    keys = [draft_key(s) for s in range(10_000)]
    assert len(set(keys)) == len(keys) and all(0 <= k < 1 << 63 for k in keys)
    verify_keys = [verify_key(s) for s in range(10_000)]
    assert len(set(verify_keys) | set(keys)) == 2 * len(keys)  # two streams per seed
    top = [draft_key(s) for s in (2**63 - 1, 2**63, 2**64 - 1)] + [verify_key(2**64 - 1)]
    assert len(set(top)) == 4 and all(0 <= k < 1 << 63 for k in top)  # the API's whole range


def test_counter_draws_are_uniform_batch_free_and_apart_from_the_drafts():
    """The verifier's counter draws (verification.CounterDraws): a request's j-th number
    depends on its key and counter only (not on its batch-mates, nor on how many it draws);
    another counter gives fresh numbers; they pass a chi-square test of uniformity (64 bins,
    2^16 draws); and for the same seed and root they are uncorrelated with the draft's."""
    seeds = range(256)
    keys = torch.tensor([[verify_key(s), 17] for s in seeds])  # [256, 2]
    u = draw_uniforms(CounterDraws(keys), 256, 256, torch.device("cpu"))  # [256, 256]
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(draw_uniforms(CounterDraws(keys[9:11]), 2, 5, u.device), u[9:11, :5])
    moved = draw_uniforms(CounterDraws(keys + torch.tensor([0, 1])), 256, 256, u.device)
    assert not bool((moved == u).any())
    counts = torch.histc(u.flatten().float(), bins=64, min=0.0, max=1.0)
    expected = u.numel() / 64
    assert float(((counts - expected) ** 2 / expected).sum()) < 123.0  # 63 dof: P ≈ 1e-5
    drafts = draft_uniforms(torch.tensor([[draft_key(s), 17] for s in seeds]), 1, 256)
    corr = torch.corrcoef(torch.stack([u.flatten(), drafts.flatten()]))[0, 1]
    assert abs(float(corr)) < 0.02  # 2^16 pairs: 5 standard errors
    with pytest.raises(ValueError, match="counter keys"):
        draw_uniforms(CounterDraws(keys[:3]), 4, 2, u.device)


def test_plain_rows_sample_with_the_verifier_s_first_number():
    """A plain request's token: inverse CDF of its root row at u = the verifier's first number
    for the same key and root position."""
    probs = torch.tensor([[[0.25, 0.25, 0.5]]]).expand(64, 1, 3)
    draws = torch.tensor([[verify_key(s), 3] for s in range(64)])
    u = draw_uniforms(CounterDraws(draws), 64, 1, probs.device)[:, 0]
    expected = (u >= 0.25).long() + (u >= 0.5).long()
    assert torch.equal(sample(probs, draws)[:, 0], expected)


def test_a_law_over_other_tensors_processes_as_its_params():
    """The draft's proposal graph processes its rows from a Law's static copies (Law.on): the
    rows of `process`, bit for bit, and the law's key (`steps`) names every step that runs,
    not the values (one graph serves any temperatures, top-k and top-p of those steps)."""
    gen = torch.Generator().manual_seed(4)
    settings = [SamplingParams(0.7, 5, 0.9), SamplingParams(0.0), SamplingParams(1.0, 0, 0.5)]
    logits = 3 * torch.randn(len(settings), 2, 40, generator=gen)  # [n, R, V]
    law = law_of(settings, 40, logits.device)
    copies = law.on([t.clone() for t in law.tensors])
    assert copies.steps == law.steps == (True, True, True, True, 40)
    assert torch.equal(apply_law(logits, copies), process(logits, settings))
    plain = law_of([SamplingParams()] * 3, 40, logits.device)
    assert plain.tensors == [] and plain.steps == (False, False, False, False, 0)
    assert law_of([SamplingParams(0.5, 3)] * 3, 40, logits.device).steps[:2] == (True, True)
